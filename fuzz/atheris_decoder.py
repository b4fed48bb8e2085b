"""A coverage-guided fuzz target for the Link F decoder (``sfnode.linkf.wire``), for atheris.

It feeds arbitrary bytes, cut into arbitrary slices, to :class:`~sfnode.linkf.wire.FrameDecoder`,
and decodes every frame it delivers with :func:`~sfnode.linkf.wire.decode_frame` (and the nested
token and parameter blobs of APPEND_CONTENT and SESSION_ASSIGN).  The only exception allowed out of
the decoder is :class:`~sfnode.linkf.wire.WireError` (the node turns it into a closed connection);
any other exception, a hang or a crash is a finding.  It also checks that every decoded message
encodes again without error.

atheris is not a test requirement.  To run it (Linux, CPython 3.11)::

    /work/venv/bin/pip install atheris
    mkdir -p fuzz/corpus
    PYTHONPATH=. /work/venv/bin/python fuzz/atheris_decoder.py fuzz/corpus -max_total_time=600

libFuzzer options follow the corpus folder (``-runs=N``, ``-max_len=65536``, ``-jobs=2``).  A
crash leaves a ``crash-*`` file; replay it with
``PYTHONPATH=. /work/venv/bin/python fuzz/atheris_decoder.py crash-...``.  Without atheris,
``python fuzz/atheris_decoder.py FILE...`` replays the given inputs through the same target.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sfnode.linkf.wire import (
    AppendContentMsg,
    FrameDecoder,
    SessionAssignMsg,
    WireError,
    decode_frame,
    decode_params,
    decode_tokens,
)


def test_one_input(data: bytes) -> None:
    """The target: decode ``data`` in slices; only WireError may come out."""
    if not data:
        return
    # The first byte chooses the slice size, so the streaming decoder sees every split.
    step = data[0] + 1
    body = data[1:]
    decoder = FrameDecoder()
    try:
        for at in range(0, len(body), step):
            for frame in decoder.feed(body[at : at + step]):
                try:
                    message = decode_frame(frame)
                except WireError:
                    continue
                message.payload()
                if isinstance(message, AppendContentMsg):
                    try:
                        decode_tokens(message.blocks)
                    except WireError:
                        pass
                elif isinstance(message, SessionAssignMsg):
                    decode_params(message.params)
    except WireError:
        return


def main(argv: list[str]) -> None:
    try:
        import atheris
    except ImportError:
        for name in argv[1:]:
            test_one_input(Path(name).read_bytes())
        return
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
