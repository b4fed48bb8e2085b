"""The stage planner as a pure function (sfnode.head.fleet.stage_plan): plain values in,
boundaries out; no links, no reactor.

It pins: equal or unknown speeds give the even boundaries; layers follow speed; a node's memory
caps its layers (the first and last stage's extras counted); each stage keeps at least one
layer; a clear error when the nodes cannot hold the model; and what a node's reports and a
config.json become.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.pipeline import even_boundaries
from sfnode.head.fleet.stage_plan import (
    StageModel,
    StageNode,
    StagePlanError,
    model_sizes,
    plan_boundaries,
    stage_node,
)
from sfnode.linkf.wire import CapacitySummary


def sizes(boundaries: list[int]) -> list[int]:
    """Layers per stage from end layers."""
    return [b - a for a, b in zip([0, *boundaries[:-1]], boundaries, strict=True)]


class PlanTests(SynchronousTestCase):
    def test_equal_speeds_give_the_even_boundaries(self) -> None:
        """Equal, or all unknown, speeds and no memory bound: exactly ``even_boundaries``."""
        for n, p in [(4, 2), (10, 3), (32, 4), (7, 7), (22, 5)]:
            with self.subTest(n=n, p=p):
                self.assertEqual(
                    plan_boundaries(StageModel(n), [StageNode(speed=5.0)] * p),
                    even_boundaries(n, p),
                )
                self.assertEqual(
                    plan_boundaries(StageModel(n), [StageNode()] * p), even_boundaries(n, p)
                )

    def test_layers_follow_speed(self) -> None:
        """A node three times as fast takes three times the layers."""
        nodes = [StageNode(speed=30.0), StageNode(speed=10.0)]
        self.assertEqual(plan_boundaries(StageModel(32), nodes), [24, 32])
        nodes = [StageNode(speed=10.0), StageNode(speed=20.0), StageNode(speed=10.0)]
        self.assertEqual(sizes(plan_boundaries(StageModel(12), nodes)), [3, 6, 3])

    def test_unknown_speed_counts_as_the_mean(self) -> None:
        """A node that has not reported a rate counts as the mean of those that did."""
        nodes = [StageNode(speed=10.0), StageNode(), StageNode(speed=30.0)]
        self.assertEqual(sizes(plan_boundaries(StageModel(12), nodes)), [2, 4, 6])

    def test_memory_caps_a_fast_node(self) -> None:
        """The fast node holds only what its free memory allows; the rest goes to the others,
        still in proportion to their speed."""
        model = StageModel(20, layer_bytes=100)
        nodes = [StageNode(500, 100.0), StageNode(None, 1.0), StageNode(None, 3.0)]
        self.assertEqual(sizes(plan_boundaries(model, nodes)), [5, 3, 12])

    def test_extras_count_on_the_first_and_last_stage(self) -> None:
        """The embeddings take room on the first stage and the LM head on the last: equal
        nodes then hold fewer layers at the ends."""
        model = StageModel(10, layer_bytes=100, first_bytes=250, last_bytes=350)
        nodes = [StageNode(600, 1.0), StageNode(600, 1.0), StageNode(600, 1.0)]
        self.assertEqual(sizes(plan_boundaries(model, nodes)), [3, 5, 2])

    def test_every_stage_keeps_a_layer(self) -> None:
        """A very slow node still gets one layer (a stage with none would be no stage)."""
        nodes = [StageNode(speed=1000.0), StageNode(speed=1.0)]
        self.assertEqual(plan_boundaries(StageModel(8), nodes), [7, 8])

    def test_nodes_that_cannot_hold_the_model(self) -> None:
        """Too little memory together, or one node without room for a single layer and its
        extras: a StagePlanError that says the bytes."""
        model = StageModel(10, layer_bytes=100)
        with self.assertRaises(StagePlanError) as caught:
            plan_boundaries(model, [StageNode(400, 1.0), StageNode(500, 1.0)])
        self.assertIn("cannot hold the model together: 1000 bytes needed", str(caught.exception))
        self.assertIn("room for 9 layers", str(caught.exception))
        model = StageModel(4, layer_bytes=100, first_bytes=1000)
        with self.assertRaises(StagePlanError) as caught:
            plan_boundaries(model, [StageNode(1050, 1.0), StageNode(10_000, 1.0)])
        self.assertIn("stage 0's node has 1050 bytes free", str(caught.exception))
        with self.assertRaises(StagePlanError):
            plan_boundaries(StageModel(2), [StageNode()] * 3)

    def test_boundaries_always_valid(self) -> None:
        """Over many speeds and caps the boundaries rise from above 0 to n_layers, and no
        stage passes its cap."""
        model = StageModel(30, layer_bytes=10)
        for a in range(1, 8):
            for b in range(1, 8):
                for free in (50, 120, 300):
                    nodes = [
                        StageNode(free, float(a)),
                        StageNode(None, float(b)),
                        StageNode(200, 1.0),
                    ]
                    with self.subTest(a=a, b=b, free=free):
                        layers = sizes(plan_boundaries(model, nodes))
                        self.assertEqual(sum(layers), 30)
                        self.assertGreaterEqual(min(layers), 1)
                        self.assertLessEqual(layers[0], free // 10)
                        self.assertLessEqual(layers[2], 20)


class ReportTests(SynchronousTestCase):
    def test_stage_node_from_reports(self) -> None:
        """Free memory: the GPU's free bytes when it has a GPU, else the host's memory less
        the node's resident memory; speed: its decode rate, None while 0; nothing reported:
        nothing known."""
        gpu = CapacitySummary(
            gpu_memory_bytes=8000, gpu_memory_free_bytes=3000, host_memory_bytes=9
        )
        self.assertEqual(stage_node(gpu, 5), StageNode(3000, None))
        host = CapacitySummary(host_memory_bytes=10_000, decode_tokens_per_s=42)
        self.assertEqual(stage_node(host, 4000), StageNode(6000, 42.0))
        self.assertEqual(stage_node(host, None), StageNode(10_000, 42.0))
        self.assertEqual(stage_node(None, None), StageNode())

    def test_model_sizes_from_a_config(self) -> None:
        """One layer's parameters (q, k, v, o, the three MLP matrices, two norms) times the
        dtype's width; the embeddings first, the final norm and LM head last; the LM head's
        work in layers, tied or not."""
        config = {
            "hidden_size": 8,
            "intermediate_size": 16,
            "vocab_size": 100,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "torch_dtype": "bfloat16",
        }
        per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16 + 2 * 8
        head = 800 / per_layer
        self.assertEqual(
            model_sizes(config, 4), StageModel(4, per_layer * 2, 800 * 2, (8 + 800) * 2, head)
        )
        tied = model_sizes({**config, "tie_word_embeddings": True, "torch_dtype": None}, 4)
        self.assertEqual(
            (tied.layer_bytes, tied.last_bytes, tied.head_layers), (per_layer * 4, 8 * 4, head)
        )
        self.assertEqual(model_sizes({"hidden_size": 8}, 4), StageModel(4))

    def test_a_gguf_files_config_gives_the_work_and_no_bytes(self) -> None:
        """The config.json sfnode writes of a GGUF file (``sfnode_family``) has the layers'
        sizes but no dtype: a parameter's bytes are unknown there (the file's kinds and the
        node's weights mode decide them), the LM head's work is not."""
        config = {
            "sfnode_family": "llama",
            "hidden_size": 8,
            "intermediate_size": 16,
            "vocab_size": 100,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }
        per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16 + 2 * 8
        self.assertEqual(model_sizes(config, 4), StageModel(4, head_layers=800 / per_layer))

    def test_the_lm_head_is_work_of_the_last_stage(self) -> None:
        """Equal speeds, a head worth 8 layers: 30 layers split 19 and 11 (19 = 11 + 8), and
        over three stages 12, 13 and 5 (work 12.67 each); a head worth more than the other stages'
        share leaves the last stage one layer; speeds still weigh."""
        self.assertEqual(
            plan_boundaries(StageModel(30, head_layers=8.0), [StageNode()] * 2), [19, 30]
        )
        three = plan_boundaries(StageModel(30, head_layers=8.0), [StageNode()] * 3)
        self.assertEqual(sizes(three), [12, 13, 5])
        self.assertEqual(
            plan_boundaries(StageModel(4, head_layers=50.0), [StageNode()] * 2), [3, 4]
        )
        fast_last = [StageNode(speed=10.0), StageNode(speed=30.0)]
        self.assertEqual(plan_boundaries(StageModel(32, head_layers=8.0), fast_last), [10, 32])
