"""RewardExecutor: dispatch, plug-ins, group and async rewards, timeouts and failure isolation."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from relax_rewards import RewardConfig, load_custom
from relax_rewards.executor import RewardExecutor, RewardItem

PLUGINS = Path(__file__).with_name("plugins_fixture.py")


def plugin(fn: str) -> str:
    """File-path target of a test plug-in: loadable in worker processes without any sys.path setup."""
    return f"{PLUGINS}:{fn}"


def items(*rows: tuple[str, str, dict | None]) -> list[RewardItem]:
    return [RewardItem(f"s{i}", resp, label, md, group_id=0) for i, (resp, label, md) in enumerate(rows)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hanging_reward_times_out_without_blocking_the_batch(num_workers: int, caplog, tmp_path) -> None:
    cfg = RewardConfig(_target_=plugin("sleepy_reward"), num_workers=num_workers, timeout_s=1.0)
    woke = tmp_path / "woke"  # touched when the hung call's 30 s sleep ends: nothing may wait for that
    hang = {"hang": True, "woke": str(woke)}
    batch = items(("7", "7", None), ("x", "7", hang), ("8", "8", None), ("9", "1", None))
    with RewardExecutor.from_config(cfg) as ex, caplog.at_level(logging.WARNING, "relax_rewards.executor"):
        outs = ex.score(batch)
        assert not woke.exists(), "the batch waited for the hung call instead of timing it out"
        assert [o.reward for o in outs] == [1.0, 0.0, 1.0, 0.0]
        assert [o.error for o in outs] == [None, "timeout", None, None]
        assert "timed out" in caplog.text and "sample s1" in caplog.text
        # the hung call does not hold up the next batch
        assert [o.reward for o in ex.score(items(("3", "3", None)))] == [1.0]
        assert not woke.exists(), "the next batch waited for the hung call"
        stats = ex.stats()
    assert stats["num_timeouts"] == 1 and stats["num_errors"] == 0 and stats["num_samples"] == 5
    if num_workers:
        assert stats["num_worker_restarts"] == 1  # the hung worker was killed and replaced
    else:
        assert stats["num_abandoned_threads"] == 1


@pytest.mark.parametrize("num_workers", [0, 1])
def test_raising_reward_scores_zero_with_the_error(num_workers: int, caplog) -> None:
    cfg = RewardConfig(_target_=plugin("boom_reward"), num_workers=num_workers)
    batch = items(("1", "1", None), ("2", "2", {"boom": True}), ("3", "3", None))
    with RewardExecutor.from_config(cfg) as ex, caplog.at_level(logging.WARNING, "relax_rewards.executor"):
        outs = ex.score(batch)
        assert [o.reward for o in outs] == [1.0, 0.0, 1.0]
        assert outs[1].error == "exception: ValueError: cannot grade '2'"
        assert outs[0].error is None and outs[2].error is None
        assert ex.stats()["num_errors"] == 1
    assert "sample s1" in caplog.text and "cannot grade" in caplog.text


@pytest.mark.parametrize("num_workers", [0, 1])
def test_hung_calls_run_concurrently(tmp_path: Path, num_workers: int) -> None:
    """Each call's timeout runs beside the others': every hung call started before the first timed out."""
    log = tmp_path / "starts"
    cfg = RewardConfig(_target_=plugin("logged_sleepy_reward"), num_workers=num_workers, timeout_s=1.0)
    batch = [RewardItem(f"h{i}", "7", "7", {"hang": True, "log": str(log)}, i) for i in range(4)]
    batch.append(RewardItem("ok", "7", "7", {"log": str(log)}, 4))
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(batch)
    assert [o.error for o in outs] == ["timeout"] * 4 + [None]
    starts = sorted(float(t) for t in log.read_text().split())
    assert len(starts) == 5 and starts[-1] < starts[0] + cfg.timeout_s


def test_exit_or_segfault_in_a_reward_costs_only_its_samples_by_default() -> None:
    """The default runner is the process pool: os._exit and a segfault end a worker, not the run, and the
    calls that ran beside them in that worker are scored again."""
    cfg = RewardConfig(_target_=plugin("crash_reward"), timeout_s=5.0)
    batch = items(
        ("1", "1", None),
        ("2", "2", {"crash": True}),
        ("3", "3", None),
        ("4", "4", {"segfault": True}),
        ("5", "5", None),
    )
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(batch)
        assert [o.reward for o in ex.score(items(("6", "6", None)))] == [1.0]  # the pool still serves
    assert [o.reward for o in outs] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [o.error for o in outs] == [
        None,
        "exception: reward worker process died (exit code 3)",
        None,
        "exception: reward worker process died (exit code -11)",
        None,
    ]


def test_crashing_worker_is_replaced() -> None:
    cfg = RewardConfig(_target_=plugin("crash_reward"), num_workers=1, timeout_s=5.0)
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(items(("1", "1", None), ("2", "2", {"crash": True}), ("3", "3", None)))
        assert [o.reward for o in outs] == [1.0, 0.0, 1.0]
        assert outs[1].error == "exception: reward worker process died (exit code 3)"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dispatch_by_rm_type(num_workers: int) -> None:
    cfg = RewardConfig(name="math", num_workers=num_workers, plugins=[str(PLUGINS)])
    batch = [
        RewardItem("m1", r"so \boxed{\frac{1}{2}}", "0.5", None, 0),
        RewardItem("m2", r"so \boxed{3}", "0.5", {}, 0),
        RewardItem("g1", "Hence the answer is (B).", "B", {"rm_type": "gpqa"}, 1),
        RewardItem("d1", "12395", "12345", {"rm_type": "digits"}, 2),
        RewardItem("c1", "7", "7", {"rm_type": "fixture_boom"}, 3),  # registered by the plug-in file
        RewardItem("c2", "7", "7", {"rm_type": "fixture_boom", "boom": True}, 3),
        RewardItem("x1", "7", "7", {"rm_type": "no_such_reward"}, 4),
        # a dataset row cannot make the executor import code
        RewardItem("x2", "print(1)", {}, {"rm_type": "builtins.exec"}, 5),
        RewardItem("x3", "7", "7", {"rm_type": plugin("boom_reward")}, 6),
    ]
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(batch)
    assert [o.reward for o in outs] == [1.0, 0.0, 1.0, pytest.approx(0.8), 1.0, 0.0, 0.0, 0.0, 0.0]
    assert outs[3].extras == {"acc": 0.0}
    assert all(o.error is None for o in outs[:5])
    assert outs[5].error == "exception: ValueError: cannot grade '7'"
    for out, name in zip(outs[6:], ["no_such_reward", "builtins.exec", plugin("boom_reward")], strict=True):
        assert out.error.startswith(f"exception: unknown reward {name!r}; available rewards:")
        assert "fixture_boom" in out.error


def test_dict_reward_key_extras_and_kwargs() -> None:
    cfg = RewardConfig(_target_=plugin("length_reward"), key="len", kwargs={"scale": 2.0})
    with RewardExecutor.from_config(cfg) as ex:
        (out,) = ex.score(items(("abc", "abc", None)))
    assert out.reward == 6.0
    assert out.extras == {"match": 1.0}  # the string "note" is not a numeric extra
    # dapo's non-numeric "pred" is dropped from extras the same way
    with RewardExecutor.from_config({"name": "dapo"}) as ex:
        (out,) = ex.score(items(("Answer: 5", "5", None)))
    assert (out.reward, out.extras) == (1.0, {"acc": 1.0})
    # a dict reward without the configured key is an error for that sample
    with RewardExecutor.from_config({"_target_": plugin("length_reward"), "key": "nope"}) as ex:
        (out,) = ex.score(items(("abc", "abc", None)))
    assert out.reward == 0.0 and "without key 'nope'" in out.error


def test_custom_reward_by_dotted_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            def shout(response, label, metadata=None, *, bonus=0.0):
                return (1.0 if response == response.upper() else 0.0) + bonus
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = OmegaConf.create(
        {"name": "math", "_target_": "my_rewards_pkg.scoring.shout", "kwargs": {"bonus": 0.5}}
    )
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(items(("LOUD", None, None), ("quiet", None, None)))
    assert [o.reward for o in outs] == [1.5, 0.5]
    assert load_custom("my_rewards_pkg.scoring:shout")("X", None) == 1.0


@pytest.mark.parametrize("num_workers", [0, 1])
def test_custom_reward_by_file_path(tmp_path: Path, num_workers: int) -> None:
    path = tmp_path / "contains.py"
    path.write_text(
        "def contains(response, label, metadata=None):\n    return float(str(label) in response)\n"
    )
    cfg = RewardConfig(_target_=f"{path}:contains", num_workers=num_workers)
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(items(("the cat sat", "cat", None), ("the dog sat", "cat", None)))
    assert [o.reward for o in outs] == [1.0, 0.0]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_group_reward_sees_whole_prompt_groups(num_workers: int) -> None:
    cfg = RewardConfig(_target_=plugin("rank_group_reward"), num_workers=num_workers)
    batch = [
        RewardItem("a0", "short", None, None, group_id=0),
        RewardItem("b0", "a much longer answer", None, None, group_id=1),
        RewardItem("a1", "longer one", None, None, group_id=0),
        RewardItem("b1", "tiny", None, None, group_id=1),
        RewardItem("b2", "tidy", None, None, group_id=1),
    ]
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(batch)
        assert [o.reward for o in outs] == [1.0, 0.0, 0.0, 1.0, 1.0]
        assert ex.stats()["num_calls"] == 2  # one call per group
    bad = RewardConfig(_target_=plugin("wrong_length_group_reward"))
    with RewardExecutor.from_config(bad) as ex:
        outs = ex.score(batch[:3])  # group 0 has two samples, group 1 one
    assert [o.reward for o in outs] == [0.0, 1.0, 0.0]
    assert "returned a list of 1, expected a list of 2" in outs[0].error
    assert outs[1].error is None and outs[2].error == outs[0].error


def test_async_reward_is_awaited_concurrently_in_process() -> None:
    # each of the 8 calls returns only once all 8 have started: awaited one after another, the first
    # would wait for the others until its timeout
    cfg = RewardConfig(_target_=plugin("async_match_reward"), timeout_s=2.0)
    meet = {"delay": 0.3, "meet": 8, "batch": "awaited-together"}
    batch = [RewardItem(f"s{i}", str(i), str(i if i != 3 else 0), meet, i) for i in range(8)]
    batch.append(RewardItem("slow", "1", "1", {"delay": 10}, 9))
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(batch)
    assert [o.reward for o in outs] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert [o.error for o in outs] == [None] * 8 + ["timeout"]


def test_async_reward_in_worker_process() -> None:
    cfg = RewardConfig(_target_=plugin("async_match_reward"), num_workers=1)
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score(
            [RewardItem("s", "4", "4", {"delay": 0.01}, 0), RewardItem("t", "4", "5", {"delay": 0.01}, 0)]
        )
    assert [o.reward for o in outs] == [1.0, 0.0]


def test_bad_configs_fail_with_a_clear_message() -> None:
    with pytest.raises(KeyError, match="unknown reward 'mth'; available rewards:"):
        RewardExecutor.from_config({"name": "mth"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['timeout'\]"):
        RewardExecutor.from_config({"name": "math", "timeout": 3})
    with pytest.raises(ValueError, match=r"does not accept kwargs \['scal'\]"):
        RewardExecutor.from_config({"_target_": plugin("length_reward"), "kwargs": {"scal": 2}})
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0"):
        RewardExecutor.from_config({"name": "math", "num_workers": -1})
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        RewardExecutor.from_config({"name": "math", "timeout_s": 0})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardExecutor.from_config({"_target_": "no/such/file.py:fn"})
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        RewardExecutor.from_config({"_target_": plugin("nope")})
    with pytest.raises(ModuleNotFoundError, match="no module 'no_such_pkg' can be imported"):
        RewardExecutor.from_config({"_target_": "no_such_pkg.mod.fn"})


def test_unpicklable_reward_is_refused_for_worker_processes() -> None:
    import relax_rewards

    relax_rewards.register("test_exec_local_closure")(lambda response, label, metadata=None: 1.0)
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        RewardExecutor.from_config({"name": "test_exec_local_closure", "num_workers": 1})
    with RewardExecutor.from_config({"name": "test_exec_local_closure", "num_workers": 0}) as ex:
        assert ex.score(items(("x", None, None)))[0].reward == 1.0


def test_default_config_scores_the_digits_task_and_ascore_works() -> None:
    import asyncio

    cfg = OmegaConf.structured(RewardConfig())  # the schema as Hydra composes it
    batch = items(("12345", "12345", None), ("12395 ", "12345", None), ("123456", "12345", None))
    with RewardExecutor.from_config(cfg) as ex:
        outs = asyncio.run(ex.ascore(batch))
        stats = ex.stats()
    assert [o.reward for o in outs] == [1.0, pytest.approx(0.8), pytest.approx(5 / 6)]
    assert [o.extras for o in outs] == [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}]
    assert stats["num_samples"] == 3 and stats["num_errors"] == 0 and stats["time_s"] > 0


def test_pool_runs_in_separate_processes_and_close_stops_them() -> None:
    import os

    ex = RewardExecutor.from_config({"_target_": plugin("pid_reward"), "num_workers": 2})
    pids = {int(o.reward) for o in ex.score(items(*[("x", None, None)] * 8))}
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids  # scored in worker processes, not here
    ex.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
