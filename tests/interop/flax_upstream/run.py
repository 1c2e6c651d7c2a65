"""Runs flax's own attention tests with ``nanoattn.flax_attention_fn`` as the layers' default.

    python tests/interop/flax_upstream/run.py [pytest arguments...]

Downloads the source distribution of the installed flax version with pip into
``.cache/flax-sdist`` (once), extracts ``tests/linen/linen_attention_test.py``
and ``tests/nnx/nn/attention_test.py`` from it (with flax's ``pyproject.toml``,
whose pytest settings they run under: a warning is an error), and runs
pytest on them, in a subprocess, with ``flax_adapter_plugin.py`` (which makes the adapter
the default ``attention_fn`` of flax's three attention layers). The files are
never copied into the repository.

Exit status: pytest's, or ``NETWORK_ERROR`` (75) when the download fails for
lack of a network, with the reason on stderr.
"""

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tarfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CACHE = ROOT / ".cache" / "flax-sdist"
TEST_FILES = ("tests/linen/linen_attention_test.py", "tests/nnx/nn/attention_test.py")
CONFIG = "pyproject.toml"  # flax's pytest settings
NETWORK_ERROR = 75  # EX_TEMPFAIL
# What pip says (as warnings while it retries) when it cannot reach an index.
_NETWORK_SIGNS = re.compile(
    r"NewConnectionError|NameResolutionError|ConnectionError|connection broken|Max retries "
    r"exceeded|Could not fetch URL|Temporary failure in name resolution|Name or service not "
    r"known|Network is unreachable|Connection refused|timed out|ProxyError|SSLError|No route "
    r"to host",
    re.IGNORECASE,
)


class DownloadError(RuntimeError):
    def __init__(self, message: str, network: bool):
        super().__init__(message)
        self.network = network


def sdist(version: str) -> pathlib.Path:
    """The flax sdist of ``version`` in the cache, downloaded with pip when missing."""
    found = sorted(CACHE.glob(f"flax-{version}.tar.gz"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", f"flax=={version}"]
    command += ["--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(CACHE)]
    command += ["--retries", "2", "--timeout", "60"]  # offline: give up in minutes, not hours
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(CACHE.glob(f"flax-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        log = (result.stdout + result.stderr).strip()
        raise DownloadError(
            f"pip could not download the flax {version} sdist: {log[-2000:]}",
            network=bool(_NETWORK_SIGNS.search(log)),
        )
    return found[0]


def extract(archive: pathlib.Path, version: str) -> pathlib.Path:
    """The directory holding the two test files and flax's pytest settings, extracted
    from the archive next to it."""
    top = CACHE / f"flax-{version}"
    names = (*TEST_FILES, CONFIG)
    if not all((top / name).exists() for name in names):
        with tarfile.open(archive) as tar:
            members = [tar.getmember(f"flax-{version}/{name}") for name in names]
            tar.extractall(CACHE, members=members, filter="data")
    return top


def main(argv: list[str]) -> int:
    version = importlib.metadata.version("flax")
    try:
        top = extract(sdist(version), version)
    except DownloadError as error:
        print(error, file=sys.stderr)
        return NETWORK_ERROR if error.network else 1
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    command += ["-p", "flax_adapter_plugin", "-c", CONFIG, "--rootdir", ".", *TEST_FILES, *argv]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return subprocess.run(command, cwd=top, env={**os.environ, "PYTHONPATH": path}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
