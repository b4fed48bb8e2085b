"""sfnode installed as a user or the image installs it: a wheel built from this tree by
``deploy/install.sh --wheel``, installed by ``deploy/install.sh VENV WHEEL`` (the two steps
``deploy/Containerfile`` runs) into a fresh virtualenv, and used from a folder outside the
checkout with nothing of the checkout on the path.

The fresh virtualenv sees the dependencies already installed for the tests (torch is large)
through plain path lines in a ``.pth`` file: such a line adds a folder to ``sys.path`` without
processing that folder's own ``.pth`` files, so an editable install of sfnode there stays out.
The folders named are views of the tests' site-packages without sfnode's own files (its
package, its metadata, its twistd plugins), because tox installs sfnode there as a package: so
nothing of sfnode can come from anywhere but the fresh virtualenv, and the tests check that it
does not.  The wheel and the virtualenv are made once per test process (about 20 s) and shared
by these tests.

What is pinned: the wheel carries every module of the tree, the native library and both twistd
plugins and nothing else; every module imports from the install; ``twistd sfnode --help`` and
``twistd sfhead --help`` work; a head and a mock node started from the install serve a request
over TCP; running the install again over the same version puts the wheel's files back;
without any C compiler the node still gets the native kernels (the build the wheel
ships, docs/engine.md section 5.1), and that build uses no instruction beyond AVX2, FMA and F16C.
Building the image itself needs a container engine, which most machines running the suite
lack: that one test skips saying so.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Generator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from sfnode.engines.kernels import native_build
from tests.processes import REPO_ROOT, TWISTD, Child, mock_node_and_head

INSTALL_SH = REPO_ROOT / "deploy" / "install.sh"
X86_64 = platform.machine().lower() in ("x86_64", "amd64")


@dataclass(frozen=True)
class Install:
    """A wheel of this tree installed into a fresh virtualenv, in a folder outside the checkout."""

    root: Path
    wheel: Path
    venv: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def site_packages(self) -> Path:
        return site_packages(self.venv)

    @property
    def workdir(self) -> Path:
        """The folder processes run in: outside the checkout."""
        return self.root / "work"

    def env(self, extra: Mapping[str, str] = {}) -> dict[str, str]:
        """This environment without anything that would put the checkout on the path."""
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
        }
        env.update(PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.update(extra)
        return env

    def run(self, *args: str, env: Mapping[str, str] = {}) -> subprocess.CompletedProcess[str]:
        """The fresh virtualenv's python with ``args``, from :attr:`workdir`."""
        return subprocess.run(
            [self.python, *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=self.workdir,
            env=self.env(env),
        )

    def json(self, script: str, env: Mapping[str, str] = {}) -> Any:
        """What ``script`` (run in the fresh virtualenv) prints as JSON on its last line."""
        done = self.run("-c", script, env=env)
        if done.returncode != 0:
            raise AssertionError(f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def site_packages(venv: Path) -> Path:
    """The site-packages folder of the virtualenv ``venv``."""
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))


_install: Install | None = None


def _step(command: list[str], env: Mapping[str, str] | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )


def installed() -> Install:
    """The wheel built and installed by ``deploy/install.sh`` (once per test process)."""
    global _install
    if _install is not None:
        return _install
    root = Path(tempfile.mkdtemp(prefix="sfnode-install-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "work").mkdir()
    env = {**os.environ, "PYTHON": sys.executable}
    # The wheel is built while the virtualenv is made (about 4 s): neither needs the other.
    with ThreadPoolExecutor(1) as pool:
        built = pool.submit(
            _step, ["sh", str(INSTALL_SH), "--wheel", str(REPO_ROOT), str(root / "dist")], env
        )
        make_venv(root, root / "venv")
        built.result()
    install = Install(root, next((root / "dist").glob("sfnode-*.whl")), root / "venv")
    _step(["sh", str(INSTALL_SH), str(install.venv), str(install.wheel)], env)
    _install = install
    return install


def fresh_venv(root: Path, venv: Path, wheel: Path) -> Install:
    """A new virtualenv ``venv`` (:func:`make_venv`) for installing ``wheel``."""
    make_venv(root, venv)
    return Install(root, wheel, venv)


def make_venv(root: Path, venv: Path) -> None:
    """A new virtualenv ``venv`` that sees the tests' own dependencies, and nothing of sfnode,
    through plain path lines (not processed as site folders) to :func:`dependencies_view`."""
    _step([sys.executable, "-m", "venv", str(venv)])
    folders = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    views = [root / "dependencies" / str(index) for index in range(len(folders))]
    if not views[0].parent.exists():
        for folder, view in zip(folders, views, strict=True):
            dependencies_view(Path(folder), view)
    lines = "".join(f"{view}\n" for view in views)
    (site_packages(venv) / "test-dependencies.pth").write_text(lines)


SFNODE_PLUGINS = {"sfnode_plugins.py", "sfhead_plugins.py", "dropin.cache", "__pycache__"}


def dependencies_view(site: Path, view: Path) -> None:
    """``view``: links to everything in the site-packages folder ``site`` but sfnode's own files
    (the package, its metadata, an editable install's hooks, and its plugins in Twisted's
    ``twisted/plugins``), so that a virtualenv given ``view`` sees no other sfnode."""
    view.mkdir(parents=True)
    for entry in site.iterdir():
        name = entry.name
        if name == "sfnode" or re.match(r"(__editable__[._]*)?sfnode[-_.]", name):
            continue
        if name == "twisted" and entry.is_dir():
            _link_all_but(entry, view / name, {"plugins"})
            _link_all_but(entry / "plugins", view / name / "plugins", SFNODE_PLUGINS)
        else:
            (view / name).symlink_to(entry)


def _link_all_but(folder: Path, view: Path, left_out: set[str]) -> None:
    view.mkdir()
    for entry in folder.iterdir():
        if entry.name not in left_out:
            (view / entry.name).symlink_to(entry)


def source_modules() -> set[str]:
    """The module names of every ``.py`` file of this tree's ``sfnode``."""
    names = set()
    for path in (REPO_ROOT / "sfnode").rglob("*.py"):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import sfnode
files, failed = {}, {}
def walk_error(name):
    failed[name] = repr(sys.exc_info()[1])
for info in pkgutil.walk_packages(sfnode.__path__, "sfnode.", onerror=walk_error):
    try:
        files[info.name] = importlib.import_module(info.name).__file__
    except Exception as e:
        failed[info.name] = f"{type(e).__name__}: {e}"
files["sfnode"] = sfnode.__file__
print(json.dumps({"path": sys.path, "files": files, "failed": failed}))
"""

PLUGIN_FILES = """
import json
from twisted.plugins import sfhead_plugins, sfnode_plugins
print(json.dumps([sfnode_plugins.__file__, sfhead_plugins.__file__]))
"""

NATIVE_WITHOUT_COMPILER = """
import json, sys, tempfile
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from sfnode.engines.kernels import native
from sfnode.engines.kernels.quant import effective_weight
from sfnode.engines.weights.gather import gather_weights

folder = Path(tempfile.mkdtemp())
config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
torch.manual_seed(5)
model = LlamaForCausalLM(config).eval()
weights = gather_weights(model, "int4", dense_copies=False, kernels="native", library_dir=folder)
library = weights.family.library
layer = weights.layers[0].qkv.kernel
x = torch.randn(3, 64)
want = x @ effective_weight(layer).t()
error = float((layer(x) - want).abs().max()) / float(want.abs().max())
print(json.dumps({
    "compiler": native.compiler(), "family": weights.family.family,
    "library": str(library.path), "shipped": library.shipped, "error": error,
    "compiled": sorted(p.name for p in folder.iterdir()), "fusable": native.fusable(weights),
}))
"""


class WheelTests(SynchronousTestCase):
    """The wheel ``deploy/install.sh --wheel`` builds from this tree."""

    def test_the_wheel_carries_every_module_and_nothing_stray(self) -> None:
        """Every ``.py`` file of sfnode/ (every subpackage, found, not listed), native.c, the
        console's page, the native library built for the source it carries (on x86-64), and
        the two twistd plugins without any ``twisted/__init__.py`` or plugin cache: exactly
        those files, besides the wheel's metadata."""
        wheel = installed().wheel
        with zipfile.ZipFile(wheel) as archive:
            names = {n for n in archive.namelist() if ".dist-info/" not in n}
        want = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "sfnode").rglob("*.py")}
        want |= {
            "sfnode/engines/kernels/native.c",
            "sfnode/head/console/page.html",
            "twisted/plugins/sfnode_plugins.py",
            "twisted/plugins/sfhead_plugins.py",
        }
        if X86_64:
            folder = Path("sfnode/engines/kernels", native_build.SHIPPED_FOLDER)
            want.add(str(folder / native_build.shipped_name(native_build.source())))
            self.assertRegex(wheel.name, r"-cp3\d+-cp3\d+-linux_x86_64\.whl$")
        self.assertEqual(sorted(names - want), [])
        self.assertEqual(sorted(want - names), [])


class InstalledTests(SynchronousTestCase):
    """The fresh virtualenv ``deploy/install.sh`` installed the wheel into."""

    def test_every_module_imports_from_the_install(self) -> None:
        """Walking the installed package finds every module of this tree's sfnode, each
        imports, and each (sfnode itself included) is a file of the fresh virtualenv: no
        entry of ``sys.path`` leads to the checkout's sfnode."""
        install = installed()
        found = install.json(IMPORT_EVERY_MODULE)
        self.assertEqual(found["failed"], {})
        self.assertEqual(set(found["files"]), source_modules())
        outside = {
            name: path
            for name, path in found["files"].items()
            if not Path(path).resolve().is_relative_to(install.site_packages.resolve())
        }
        self.assertEqual(outside, {})
        # The dependencies' folder may lie inside the checkout (tox's .tox/): what must not be
        # on the path is the checkout's root, where its sfnode/ could be imported from.
        source = [
            entry
            for entry in found["path"]
            if (Path(entry or install.workdir) / "sfnode").resolve() == REPO_ROOT / "sfnode"
        ]
        self.assertEqual(source, [])

    def test_the_sfnode_script_and_the_console_page(self) -> None:
        """The install's ``sfnode`` script runs ``sfnode top --help``, and the console's page
        is read from the installed package."""
        install = installed()
        done = subprocess.run(
            [str(install.venv / "bin" / "sfnode"), "top", "--help"],
            capture_output=True, text=True, env=install.env(), cwd=install.workdir, timeout=300,
            check=False,
        )  # fmt: skip
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("usage: sfnode top", done.stdout)
        page = install.run("-c", "from sfnode.head.api.console import page; print(len(page()))")
        self.assertEqual(page.returncode, 0, page.stderr)
        self.assertGreater(int(page.stdout), 1000)

    def test_twistd_sfnode_and_sfhead_help(self) -> None:
        """``twistd sfnode --help`` and ``twistd sfhead --help`` exit 0 with each plugin's own
        usage line, ``twistd --help`` lists both plugins, and both plugin modules are the
        fresh virtualenv's files."""
        install = installed()
        for plugin, usage in (("sfnode", "--listen ENDPOINT"), ("sfhead", "--node ENDPOINT")):
            done = install.run("-c", TWISTD, plugin, "--help")
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertIn(f"Usage: twistd [options] {plugin} ", done.stdout)
            self.assertIn(usage, done.stdout)
        listed = install.run("-c", TWISTD, "--help").stdout
        for plugin in ("sfnode", "sfhead"):
            self.assertRegex(listed, rf"\n\s+{plugin}\s+A Link F")
        files = install.json(PLUGIN_FILES)
        self.assertEqual(
            [Path(path).parent for path in files],
            [install.site_packages / "twisted" / "plugins"] * 2,
        )

    def test_without_a_compiler_the_node_gets_the_shipped_native_kernels(self) -> None:
        """With ``CC`` naming a compiler that does not exist and no compiler on PATH, the
        node's weights (int4, ``--kernels native``) still multiply with sfnode's native
        kernels: the build the wheel shipped, loaded from the install, nothing compiled; the
        product is right and the whole step can run natively."""
        self.require_native()
        install = installed()
        empty = install.root / "no-compiler-here"
        empty.mkdir(exist_ok=True)
        found = install.json(
            NATIVE_WITHOUT_COMPILER,
            env={"CC": str(install.root / "no-such-cc"), "PATH": str(empty)},
        )
        self.assertEqual(
            (found["compiler"], found["family"], found["shipped"], found["compiled"]),
            (None, "native", True, []),
        )
        folder = install.site_packages / "sfnode/engines/kernels" / native_build.SHIPPED_FOLDER
        self.assertEqual(Path(found["library"]).parent, folder)
        self.assertLess(found["error"], 1e-3)
        self.assertIsNone(found["fusable"])

    def test_the_shipped_build_needs_only_avx2_fma_and_f16c(self) -> None:
        """The shipped library has no AVX-512 instruction (no zmm or mask register), needs
        only libc, libm and the OpenMP runtime torch ships (by its soname), and names no
        folder of the machine that built it."""
        self.require_native()
        objdump, readelf = shutil.which("objdump"), shutil.which("readelf")
        if objdump is None or readelf is None:
            raise SkipTest("binutils (objdump, readelf) is not installed")
        folder = installed().site_packages / "sfnode/engines/kernels" / native_build.SHIPPED_FOLDER
        [library] = folder.glob("*.so")
        code = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True)
        self.assertEqual(code.returncode, 0, code.stderr)
        self.assertIn("%ymm", code.stdout)
        self.assertEqual(re.findall(r"%zmm\d+|\{%k\d\}", code.stdout), [])
        dynamic = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True)
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", dynamic.stdout))
        self.assertEqual(needed, {"libc.so.6", "libm.so.6", "libgomp.so.1"})
        self.assertNotRegex(dynamic.stdout, r"RPATH|RUNPATH")

    def require_native(self) -> None:
        if not X86_64:
            raise SkipTest("sfnode's native kernels are for x86-64 only")
        flags = native_build.NEEDED_FLAGS
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        if not all(re.search(rf"\b{flag}\b", cpuinfo) for flag in flags):
            raise SkipTest(f"this CPU lacks one of {', '.join(sorted(flags))}")


class ReinstallTests(SynchronousTestCase):
    """``deploy/install.sh`` run again over a virtualenv that holds sfnode already."""

    def test_installing_over_the_same_version_puts_the_wheels_files_back(self) -> None:
        """Over an install of the same version whose files differ (an install from the tree
        before a change: the version number stays), ``deploy/install.sh VENV WHEEL`` leaves
        the wheel's files, where pip alone keeps the old ones."""
        install = installed()
        again = fresh_venv(install.root, install.root / "venv-again", install.wheel)
        # In the fresh virtualenv's own environment: trial's workers (-j) put the runner's
        # sys.path on PYTHONPATH, where pip would find sfnode installed and install nothing.
        _step([again.python, "-m", "pip", "install", "--no-deps", str(install.wheel)], again.env())
        module = "sfnode/cli/launcher.py"
        (again.site_packages / module).write_text("raise SystemExit('the old install')\n")
        env = {**os.environ, "PYTHON": sys.executable}
        _step(["sh", str(INSTALL_SH), str(again.venv), str(install.wheel)], env)
        with zipfile.ZipFile(install.wheel) as archive:
            wanted = archive.read(module)
        self.assertEqual((again.site_packages / module).read_bytes(), wanted)


class ServingTests(TestCase):
    """A head and a mock node, both ``twistd`` processes of the install, serve a request."""

    timeout = 300

    def spawn(self, name: str, args: list[str]) -> Child:
        install = installed()
        child = Child(name)
        child.transport = reactor.spawnProcess(
            child,
            install.python,
            [install.python, "-c", TWISTD, "--pidfile=", "-n", *args],
            env=install.env(),
            path=str(install.workdir),
        )
        self.addCleanup(child.kill)
        return child

    @defer.inlineCallbacks
    def test_a_head_and_a_mock_node_from_the_install_serve_a_request(
        self,
    ) -> Generator[Any, Any, None]:
        """``twistd sfnode --engine mock`` listening on loopback and ``twistd sfhead`` dialing
        it, both run by the fresh virtualenv's python from outside the checkout: a completion
        of 5 tokens comes back over real TCP, whole."""
        _, _, base = yield mock_node_and_head(self.spawn, "installed")
        url = base + "/v1/completions"
        body = {"model": "mock", "prompt": list(range(100, 112)), "max_tokens": 5,
                "temperature": 0}  # fmt: skip
        response = yield Agent(reactor).request(
            b"POST",
            url.encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        answer = json.loads((yield readBody(response)))
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer["usage"]["completion_tokens"], 5)
        self.assertEqual(answer["choices"][0]["finish_reason"], "length")
        self.assertTrue(answer["choices"][0]["text"])


class ImageTests(SynchronousTestCase):
    """``deploy/Containerfile`` built for real, where a container engine runs."""

    def test_the_image_builds_and_runs_both_roles(self) -> None:
        """The image builds from this tree (its RUN lines call deploy/install.sh, as the tests
        above do), and ``sfnode --help`` and ``sfhead --help`` run in it."""
        tool, why = container_tool()
        if tool is None:
            raise SkipTest(f"the image is not built here: {why}")
        tag = "localhost/sfnode-install-test"
        build = subprocess.run(
            [tool, "build", "-f", str(REPO_ROOT / "deploy" / "Containerfile"), "-t", tag,
             str(REPO_ROOT)],
            capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        self.assertEqual(build.returncode, 0, build.stdout[-3000:] + build.stderr[-3000:])
        self.addCleanup(subprocess.run, [tool, "rmi", "-f", tag], capture_output=True)
        for role in ("sfnode", "sfhead"):
            done = run_in_image(tool, tag, [role, "--help"])
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertIn(f"Usage: twistd [options] {role} ", done.stdout)


def run_in_image(tool: str, tag: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """The image's entry point with ``args``, in a container removed afterwards."""
    if Path(tool).name != "buildah":
        command = [tool, "run", "--rm", tag, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)
    # buildah runs a command in a working container, not the entry point.
    made = subprocess.run([tool, "from", tag], capture_output=True, text=True, timeout=300)
    if made.returncode != 0:
        return made
    container = made.stdout.strip().splitlines()[-1]
    try:
        entry = ["/opt/sfnode/bin/twistd", "--nodaemon", "--pidfile="]
        command = [tool, "run", container, "--", *entry, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run([tool, "rm", container], capture_output=True, timeout=300)


def container_tool() -> tuple[str | None, str]:
    """The first container tool whose engine answers (podman, buildah, docker), or why none."""
    tried = []
    for name in ("podman", "buildah", "docker"):
        path = shutil.which(name)
        if path is None:
            continue
        probe = [path, "info"]
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{name}: {e}")
            continue
        if done.returncode == 0:
            return path, ""
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        tried.append(f"{name} info failed: {last}")
    return None, "; ".join(tried) or "no podman, buildah or docker is installed"
