"""``python -m sfnode fleet``: a whole fleet on this machine in one command (a head and a node).

Starts ``twistd -n sfnode`` (on the bundled SmolLM2 by default), with ``--embedding-model
FOLDER`` a second node serving that sentence-transformers folder to ``/v1/embeddings``, and
``twistd -n sfhead`` dialing them as child processes, waits until the head's ``/healthz`` says
every node is live, prints a ``curl`` line that works and the console's address, and then runs
until Ctrl-C or SIGTERM, which stops the children (SIGTERM, so they drain) and exits 0.

The children run in sessions of their own: a Ctrl-C in the terminal reaches only this process,
which then stops each child once (a child that got the terminal's SIGINT and then a SIGTERM
would try to stop its reactor twice).  The head redials its node at least every second: on one
machine a node that does not answer yet is only loading its model, and the first request
should not wait for a long backoff; a request sent meanwhile waits for it (the head's
``--node-start-timeout``, as long as this launcher waits for the fleet) instead of getting 503.

This is an operator's convenience, not library code: it must never be imported by sfnode itself,
and never leave a child running when it exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from types import FrameType
from typing import NoReturn

PROG = "python -m sfnode fleet"
TWISTD = "import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"
READY_TIMEOUT_S = 600.0
"""The first start converts the bundled GGUF model (about half a minute, more on slow disks)."""


def _twistd(*args: str) -> list[str]:
    return [sys.executable, "-c", TWISTD, "--pidfile=", "-n", *args]


def _healthy(url: str, nodes: int = 1) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(json.load(response).get("nodes", 0) >= nodes)
    except (OSError, ValueError, urllib.error.URLError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    *node_args, head_args = _daemon_args(options)
    children = [
        *(subprocess.Popen(_twistd(*args), start_new_session=True) for args in node_args),
        subprocess.Popen(_twistd(*head_args), start_new_session=True),
    ]
    stop = _stopper(children)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    base = f"http://127.0.0.1:{options.http_port}"
    try:
        _wait_until_ready(base, children, stop, len(node_args))
        _print_a_request(base, "mock" if options.engine == "mock" else _served_model(base))
        while all(child.poll() is None for child in children):
            time.sleep(1)
        print(f"{PROG}: a child exited; stopping the other", file=sys.stderr)
        stop(1)
    except BaseException:
        # Whatever ends this process (an error included) must not leave a child running.
        for child in children:
            if child.poll() is None:
                child.kill()
        raise
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a head and one node on this machine."
    )
    parser.add_argument("--engine", default="transformers", choices=("transformers", "mock"))
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--node-port", type=int, default=8454)
    parser.add_argument("--http-port", type=int, default=8453)
    parser.add_argument("--fleet-port", type=int, default=8455)
    parser.add_argument(
        "--embedding-model",
        default=None,
        help="also a node serving this sentence-transformers folder to /v1/embeddings",
    )
    parser.add_argument("--embedding-port", type=int, default=8456)
    return parser


def _daemon_args(options: argparse.Namespace) -> list[list[str]]:
    """The twistd arguments of each node (the generating one, then an embedding one when
    asked for), then of the head dialing them."""
    node_args = ["sfnode", "--listen", f"tcp:{options.node_port}:interface=127.0.0.1",
                 "--engine", options.engine]  # fmt: skip
    head_args = [
        "sfhead",
        "--node", f"tcp:127.0.0.1:{options.node_port}",
        "--http", f"tcp:{options.http_port}:interface=127.0.0.1",
        "--fleet-listen", f"tcp:{options.fleet_port}:interface=127.0.0.1",
        "--reconnect-max", "1",
        "--node-start-timeout", f"{READY_TIMEOUT_S:g}",
    ]  # fmt: skip
    if options.model:
        node_args += ["--model", options.model]
        head_args += ["--model", options.model]
    if options.engine == "mock":
        # Mock tokens are ids below 32000: any tokenizer at least that large renders them.
        head_args += ["--model-name", "mock"]
    if options.embedding_model is None:
        return [node_args, head_args]
    embedding_args = ["sfnode", "--listen", f"tcp:{options.embedding_port}:interface=127.0.0.1",
                      "--model", options.embedding_model]  # fmt: skip
    head_args += ["--node", f"tcp:127.0.0.1:{options.embedding_port}"]
    return [node_args, embedding_args, head_args]


def _stopper(children: list[subprocess.Popen[bytes]]) -> Callable[..., NoReturn]:
    """The handler of SIGINT and SIGTERM (and of a failure, called with 1): stops each child
    once (SIGTERM, so they drain; SIGKILL after 40 s) and exits, 0 unless a failure."""

    def stop(signum: int = 0, frame: FrameType | None = None) -> NoReturn:
        # A second Ctrl-C while the children drain must not interrupt this with a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if signum in (signal.SIGINT, signal.SIGTERM):
            print("\nsfnode.fleet: stopping the head and the node", file=sys.stderr, flush=True)
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=40)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        raise SystemExit(0 if signum in (0, signal.SIGINT, signal.SIGTERM) else 1)

    return stop


def _wait_until_ready(
    base: str,
    children: list[subprocess.Popen[bytes]],
    stop: Callable[[int], NoReturn],
    nodes: int = 1,
) -> None:
    """Returns once the head's ``/healthz`` reports ``nodes`` live nodes; stops everything
    with 1 when a child exits first or the fleet is not ready in :data:`READY_TIMEOUT_S`."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _healthy(base + "/healthz", nodes):
        if any(child.poll() is not None for child in children):
            print(f"{PROG}: a child exited before the fleet was ready", file=sys.stderr)
            stop(1)
        if time.monotonic() > deadline:
            print(f"{PROG}: the fleet did not become ready in time", file=sys.stderr)
            stop(1)
        time.sleep(0.5)


def _print_a_request(base: str, model: str) -> None:
    """The ``curl`` line that asks the fleet a question it answers right, and where to watch
    the fleet (``/console``, ``sfnode top``)."""
    # temperature 0 (greedy): OpenAI's default of 1 samples freely, and a 135M model
    # sampled at 1 rambles; greedy answers this one right ("... is Paris.").
    question = "What is the capital of France?"
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": question}],
         "max_tokens": 32, "temperature": 0}
    )  # fmt: skip
    print(f"\nThe fleet is up on {base}. Try:\n")
    print(f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\")
    print(f"       -d '{body}'\n")
    print(f"Watch it live at {base}/console (in a terminal: python -m sfnode top --url {base})\n",
          flush=True)  # fmt: skip


def _served_model(base: str) -> str:
    """The model that chats (not the embedding model, when there is one)."""
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as response:
        models = json.load(response)["data"]
    chats = [m for m in models if m.get("capabilities", {}).get("chat", True)]
    return str((chats or models)[0]["id"])


if __name__ == "__main__":
    sys.exit(main())
