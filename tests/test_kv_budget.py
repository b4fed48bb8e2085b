"""Tests of the keys and values' memory bound without ``--kv-blocks`` (``EngineConfig.kv_memory``,
``within_memory``, ``sfnode.node.tap.kv_memory``; docs/engine.md section 3)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from twisted.trial import unittest

from sfnode.engines.config import EngineConfig
from sfnode.node import tap

BLOCK = 24 * 2 * 2 * 16 * 64 * 4
"""One block of a Qwen2.5-0.5B-shaped model counted in float32 (24 layers, 2 KV heads of 64)."""


class WithinMemoryTests(unittest.SynchronousTestCase):
    def test_a_full_window_a_lane_when_memory_allows(self) -> None:
        """With memory to spare, the pool is a full window for every lane, as without a bound."""
        config = EngineConfig(max_lanes=8, kv_memory=10**12).within_memory(BLOCK, 32768)
        self.assertEqual(config.kv_blocks, 8 * 32768 // 16)

    def test_the_blocks_that_fit_the_memory(self) -> None:
        """With less memory, the blocks whose slots and prefix pool together fit in it; without
        a prefix cache only the slots count."""
        memory = 1000 * BLOCK
        config = EngineConfig(max_lanes=8, kv_memory=memory).within_memory(BLOCK, 32768)
        self.assertEqual(config.kv_blocks, 500)
        self.assertEqual(config.kv_sizes(32768), (500 * 16, 500))
        alone = EngineConfig(max_lanes=8, kv_memory=memory, prefix_cache=False)
        self.assertEqual(alone.within_memory(BLOCK, 32768).kv_blocks, 1000)

    def test_at_least_256_positions_a_lane(self) -> None:
        """However little memory the machine has, every lane keeps 256 positions."""
        config = EngineConfig(max_lanes=8, kv_memory=BLOCK).within_memory(BLOCK, 32768)
        self.assertEqual(config.kv_blocks, 8 * 16)

    def test_an_explicit_pool_or_no_bound_is_kept(self) -> None:
        """``--kv-blocks`` wins over the bound, and no bound changes nothing."""
        given = EngineConfig(kv_blocks=7, kv_memory=BLOCK)
        self.assertIs(given.within_memory(BLOCK, 32768), given)
        unbound = EngineConfig()
        self.assertIs(unbound.within_memory(BLOCK, 32768), unbound)


class KvMemoryTests(unittest.SynchronousTestCase):
    def test_a_share_of_the_available_memory(self) -> None:
        """The bound is a quarter of ``MemAvailable``; a system that does not say gives none."""
        folder = Path(tempfile.mkdtemp(prefix="sfnode-meminfo-"))
        meminfo = folder / "meminfo"
        meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
        self.assertEqual(tap.kv_memory(meminfo), 8000000 * 1024 // 4)
        meminfo.write_text("MemTotal:       24000000 kB\n")
        self.assertIsNone(tap.kv_memory(meminfo))
        self.assertIsNone(tap.kv_memory(folder / "absent"))

    def test_the_node_options_carry_the_bound(self) -> None:
        """The node's engine configuration carries the bound unless ``--kv-blocks`` is given.

        The machine's available memory moves between two reads, so the bound is read once here
        (how it is read is pinned by the test above)."""
        bound = tap.kv_memory()
        self.patch(tap, "kv_memory", lambda: bound)
        options = tap.Options()
        options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", "--engine", "mock"])
        self.assertEqual(tap.engine_config(options).kv_memory, bound)
        options = tap.Options()
        options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", "--kv-blocks", "64"])
        config = tap.engine_config(options)
        self.assertEqual(config.kv_blocks, 64)
        self.assertIs(config.within_memory(BLOCK, 32768), config)
