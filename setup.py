"""Packages of the monorepo, plus the top-level ``conf/`` tree installed as ``relax_launch.conf``.

pyproject's ``packages.find`` cannot map a top-level folder into another package, hence this file.
"""

from setuptools import find_namespace_packages, find_packages, setup

CODE = find_packages(include=["relax_launch*", "relax_core*", "relax_rewards*", "relax_models*"])
CONFIG_GROUPS = [f"relax_launch.conf.{group}" for group in find_namespace_packages(where="conf")]

setup(
    packages=[*CODE, "relax_launch.conf", *CONFIG_GROUPS],
    package_dir={"relax_launch.conf": "conf"},
    package_data={
        "relax_launch.conf": ["*.yaml"],
        **{group: ["*.yaml"] for group in CONFIG_GROUPS},
        "relax_core.engines": ["*.cpp"],  # the native decode kernels, compiled on first use
    },
)
