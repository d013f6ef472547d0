"""The runtime wheel ships the server extension alone: the benchmarks (`bench/`, `bench_*.py`)
and the demo stay in the checkout, where `python -m sglang_tokendance.bench_*` runs them (the
editable install of scripts/setup_cpu.sh maps the whole source folder)."""

from setuptools import setup
from setuptools.command.build_py import build_py

CHECKOUT_ONLY = ("bench", "demo")  # module names starting with these, and the bench/ package


class RuntimeModules(build_py):
    """build_py without the checkout-only modules of sglang_tokendance."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package != "sglang_tokendance":
            return modules
        return [(pkg, name, path) for pkg, name, path in modules if not name.startswith(CHECKOUT_ONLY)]


setup(cmdclass={"build_py": RuntimeModules})
