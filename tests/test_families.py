"""Tests of the model families and the stored-weights reader (docs/engine.md section 5.4):
each family's tiny model (``tests/families.py``) read from its folder and from its GGUF files
gives one spec and the same weights; K-quant files are held as stored; what is not supported is
refused by name; the rope tables are transformers'.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from twisted.trial import unittest

from sfnode.engines import ModelLoadError
from sfnode.engines.families import spec_from_config
from sfnode.engines.families.rope import Rope
from sfnode.engines.families.spec import ModelSpec
from sfnode.engines.kernels.maps import give_back, resident_bytes, row_file
from sfnode.engines.weights.stored import StoredModel, read_folder, read_gguf
from tests import families
from tests.tinymodel import reference_greedy

_root = Path(tempfile.mkdtemp(prefix="sfnode-families-refused-"))
folder, gguf = families.folder, families.gguf


def converter_drops(spec: ModelSpec) -> ModelSpec:
    """What llama.cpp's converter keeps of a spec: a Mistral folder becomes architecture
    ``llama`` without its window (the converter writes none)."""
    if spec.family == "mistral":
        return dataclasses.replace(spec, family="llama", sliding_window=None)
    return spec


def _bits(values: Any) -> Any:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


class SpecTests(unittest.SynchronousTestCase):
    def test_folder_and_gguf_give_one_spec(self) -> None:
        """Every family's spec read from its folder equals the one read from its GGUF files
        (F32, Q8_0, Q4_K_M), but for what the converter itself drops (Mistral's window)."""
        for family in families.FAMILY_NAMES:
            from_folder = read_folder(folder(family)).spec
            for kind in ("F32", "Q8_0", "Q4_K_M"):
                with self.subTest(family=family, kind=kind):
                    self.assertEqual(
                        read_gguf(gguf(family, kind)).spec, converter_drops(from_folder)
                    )

    def test_each_family_reads_its_own_features(self) -> None:
        """The spec says what makes each family itself (a reader that dropped a feature
        would give the plain Llama spec)."""
        spec = {f: read_folder(folder(f)).spec for f in families.FAMILY_NAMES}
        self.assertEqual(spec["llama"].rope.scaling, "llama3")
        self.assertTrue(spec["qwen2"].qkv_bias and spec["qwen2"].tied_embeddings)
        self.assertFalse(spec["qwen2"].o_bias)
        self.assertTrue(spec["qwen3"].qk_norm)
        self.assertEqual(spec["mistral"].sliding_window, families.WINDOW)
        gemma2 = spec["gemma2"]
        self.assertEqual((gemma2.attn_softcap, gemma2.final_softcap), (50.0, 30.0))
        self.assertEqual(gemma2.sliding_layers, (True, False))
        self.assertEqual((gemma2.norm_offset, gemma2.activation), (1.0, "gelu_tanh"))
        self.assertEqual(gemma2.embed_scale, 16.0)
        gemma3 = spec["gemma3"]
        self.assertEqual(gemma3.sliding_layers, (True,) * 5 + (False,))
        self.assertEqual((gemma3.rope.scaling, gemma3.rope.factor), ("linear", 2.0))
        self.assertEqual(gemma3.rope_of(0), Rope(10000.0, 64))
        self.assertEqual(gemma3.rope_of(5).base, 1000000.0)
        self.assertTrue(spec["phi3"].fused_qkv and spec["phi3"].fused_gate_up)
        self.assertEqual(spec["phi3"].rope.dims, 32)

    def test_unknown_architecture_and_model_type_are_refused_by_name(self) -> None:
        """A GGUF architecture or a model_type no family reads is refused with its name."""
        with self.assertRaises(ModelLoadError) as caught:
            spec_from_config({"model_type": "falcon"})
        self.assertIn("'falcon'", str(caught.exception))
        path = _root / "mamba.gguf"
        shutil.copy(gguf("qwen2", "F32"), path)
        data = bytearray(path.read_bytes())
        at = data.index(b"qwen2")
        data[at : at + 5] = b"mamba"
        path.write_bytes(bytes(data))
        with self.assertRaises(ModelLoadError) as caught:
            read_gguf(path)
        self.assertIn("GGUF architecture 'mamba' is not supported", str(caught.exception))

    def test_unsupported_rope_is_refused_by_name(self) -> None:
        """A rope type no family computes (longrope) is refused naming the family, the key and
        the value; so is a Qwen2 sliding window."""
        config = json.loads((folder("llama") / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
        with self.assertRaises(ModelLoadError) as caught:
            spec_from_config(config)
        self.assertEqual(
            str(caught.exception), "llama: config.json rope_type = 'longrope' is not supported"
        )
        qwen = json.loads((folder("qwen2") / "config.json").read_text())
        qwen["use_sliding_window"] = True
        with self.assertRaises(ModelLoadError) as caught:
            spec_from_config(qwen)
        self.assertIn("use_sliding_window = True", str(caught.exception))

    def test_a_gguf_key_no_family_reads_is_refused_by_name(self) -> None:
        """A ``{arch}.*`` key the family does not read (here Qwen2 given an expert count) is
        refused with the architecture, the key and the value, not dropped."""
        import gguf as gguf_package

        path = _root / "qwen2-experts.gguf"
        reader = gguf_package.GGUFReader(str(gguf("qwen2", "F32")))
        writer = gguf_package.GGUFWriter(str(path), "qwen2")
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            kind = field.types[0]
            value = field.contents()
            if kind == gguf_package.GGUFValueType.ARRAY:
                writer.add_array(field.name, value)
            else:
                writer.add_key_value(field.name, value, kind)
        writer.add_expert_count(4)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with self.assertRaises(ModelLoadError) as caught:
            read_gguf(path)
        self.assertEqual(
            str(caught.exception), "qwen2: GGUF key qwen2.expert_count = 4 is not supported"
        )


class StoredWeightsTests(unittest.SynchronousTestCase):
    models: ClassVar[dict[tuple[str, str], StoredModel]] = {}

    def stored(self, family: str, kind: str) -> StoredModel:
        key = (family, kind)
        if key not in self.models:
            self.models[key] = (
                read_folder(folder(family)) if kind == "folder" else read_gguf(gguf(family, kind))
            )
        return self.models[key]

    def test_f32_gguf_holds_the_folders_weights_bit_for_bit(self) -> None:
        """Every tensor of every family's F32 GGUF file, read by sfnode's names (query/key rows
        put back, fused matrices split, Gemma's norms as stored), is the folder's tensor (with
        the norm offset added) bit for bit, and no tensor is missing or extra."""
        for family in families.FAMILY_NAMES:
            with self.subTest(family=family):
                ours, theirs = self.stored(family, "folder"), self.stored(family, "F32")
                self.assertEqual(sorted(ours.tensors), sorted(theirs.tensors))
                for name, tensor in ours.tensors.items():
                    np.testing.assert_array_equal(
                        _bits(tensor.float32()), _bits(theirs.tensors[name].float32()), name
                    )

    def test_the_folder_is_the_transformers_model(self) -> None:
        """The folder reader's weights are the transformers model's own (Gemma's norms as
        ``1 + w``; Phi-3's fused rows split gate first)."""
        for family in ("gemma3", "phi3", "llama"):
            with self.subTest(family=family):
                lm = families.model(family)
                stored = self.stored(family, "folder").tensors
                layer = lm.model.layers[0]
                if family == "phi3":
                    fused = layer.mlp.gate_up_proj.weight.detach().numpy()
                    np.testing.assert_array_equal(stored["0.gate"].float32(), fused[:256])
                    np.testing.assert_array_equal(stored["0.up"].float32(), fused[256:])
                else:
                    q = layer.self_attn.q_proj.weight.detach().numpy()
                    np.testing.assert_array_equal(stored["0.q"].float32(), q)
                norm = layer.input_layernorm.weight.detach().numpy()
                offset = np.float32(1) if family == "gemma3" else np.float32(0)
                np.testing.assert_array_equal(stored["0.attn_norm"].float32(), norm + offset)

    def test_quantized_files_are_close_to_the_folder(self) -> None:
        """Q8_0 and Q4_K_M weights, read as stored and dequantized, are near the folder's
        (a misplaced row or block would be off by the weights' own size, about 0.2)."""
        for family in families.FAMILY_NAMES:
            for kind, tolerance in (("Q8_0", 0.01), ("Q4_K_M", 0.1)):
                with self.subTest(family=family, kind=kind):
                    ours, theirs = self.stored(family, "folder"), self.stored(family, kind)
                    for name in ("0.q", "0.k", "1.down", "embed"):
                        error = np.abs(
                            theirs.tensors[name].float32() - ours.tensors[name].float32()
                        ).max()
                        self.assertLess(float(error), tolerance, name)

    def test_k_quant_files_are_held_as_stored(self) -> None:
        """A Q4_K_M file's weights are held in their block formats (Q4_K and Q6_K, nothing
        inflated to float), in at most 1.1 times the file's size."""
        for family in families.FAMILY_NAMES:
            with self.subTest(family=family):
                stored = self.stored(family, "Q4_K_M")
                kinds = {t.kind for t in stored.tensors.values() if len(t.shape) == 2}
                self.assertEqual(kinds, {"Q4_K", "Q6_K"})
                size = gguf(family, "Q4_K_M").stat().st_size
                self.assertLessEqual(stored.held_bytes(), 1.1 * size)

    def test_a_tensors_pages_are_given_back_alone(self) -> None:
        """A tensor read from a file's map holds the pages read (the process's resident set,
        not the page cache's); :func:`give_back` drops its pages and none of another
        tensor's, and a later read maps them again; an array that is no map is counted whole
        and left alone."""
        path = gguf("llama", "Q8_0")
        tensors = read_gguf(path).tensors
        embed, down = tensors["embed"].data, tensors["0.down"].data
        self.assertIsInstance(embed, np.memmap)
        int(embed.sum()), int(down.sum())
        self.assertGreaterEqual(resident_bytes(embed), embed.nbytes)
        self.assertGreaterEqual(resident_bytes(down), down.nbytes)
        give_back(embed)
        self.assertEqual(resident_bytes(embed), 0)
        self.assertGreaterEqual(resident_bytes(down), down.nbytes)
        int(embed[3].sum())
        self.assertGreater(resident_bytes(embed), 0)
        plain = np.ones(1000, dtype=np.uint8)
        give_back(plain)
        self.assertEqual(resident_bytes(plain), 1000)
        self.assertEqual(int(plain.sum()), 1000)


    def test_a_tables_rows_read_from_its_file_are_the_mapped_ones(self) -> None:
        """:func:`row_file` reads a table's rows from its file with ``pread``: every row (the
        first and last among them) is the mapped one byte for byte, and reading maps none of
        the table's pages; a table whose bytes are not a file's map, or whose file was
        replaced since it was mapped, has none, and a row outside the table is refused."""
        for kind in ("Q8_0", "Q4_K_M"):
            with self.subTest(kind=kind):
                embed = read_gguf(gguf("llama", kind)).tensors["embed"].data
                rows = row_file(embed)
                assert rows is not None
                give_back(embed)
                indices = [0, 3, 17, len(embed) - 1, 3]
                read = rows.read(indices)
                self.assertEqual(resident_bytes(embed), 0)
                np.testing.assert_array_equal(read, embed[indices])
                np.testing.assert_array_equal(rows.read(range(len(embed))), embed)
                self.assertRaises(IndexError, rows.read, [len(embed)])
                self.assertRaises(IndexError, rows.read, [-1])
        self.assertIsNone(row_file(np.ones((4, 8), dtype=np.uint8)))
        copy = Path(tempfile.mkdtemp()) / "copy.gguf"
        self.addCleanup(shutil.rmtree, copy.parent)
        shutil.copy(gguf("llama", "Q8_0"), copy)
        embed = read_gguf(copy).tensors["embed"].data
        replaced = copy.with_name("replaced.gguf")
        replaced.write_bytes(bytes(copy.stat().st_size))
        replaced.replace(copy)
        self.assertIsNone(row_file(embed))
        self.assertGreater(int(np.asarray(embed[3]).sum()), 0)

    def test_converting_a_matrix_gives_back_its_pages(self) -> None:
        """Weights converted from a file's matrices (a Q8_0 file's served as int4) leave none
        of those matrices' pages of the map resident: the kernels hold copies."""
        from sfnode.engines.weights.gather import gather_weights

        stored = read_gguf(gguf("llama", "Q8_0"))
        weights = gather_weights(stored, "int4", dense_copies=False, kernels="torch")
        self.assertEqual(weights.mode, "int4")
        for name in ("0.v", "0.o", "0.gate", "0.up", "1.down", "lm_head"):
            self.assertIsInstance(stored.tensors[name].data, np.memmap)
            self.assertEqual(resident_bytes(stored.tensors[name].data), 0, name)

    def test_stored_rows_read_their_file(self) -> None:
        """A table of stored rows (the embedding of a Q8_0 file) answers the rows the map
        holds, dequantized bit for bit, and reading them maps none of its pages."""
        from sfnode.engines.kernels.blocks import dequantize
        from sfnode.engines.kernels.quant import StoredRows

        tensor = read_gguf(gguf("llama", "Q8_0")).tensors["embed"]
        table = StoredRows(tensor.kind, tensor.data, tensor.cols)
        self.assertIsNotNone(table.file)
        give_back(tensor.data)
        picked = table[torch.tensor([[5, 2], [2, 9]])]
        self.assertEqual(resident_bytes(tensor.data), 0)
        mapped = dequantize(tensor.kind, np.asarray(tensor.data[[5, 2, 2, 9]]), tensor.cols)
        np.testing.assert_array_equal(picked.reshape(4, -1).numpy(), mapped)


class RopeTests(unittest.SynchronousTestCase):
    def _transformers(self, params: dict[str, Any], length: int | None = None) -> Any:
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = LlamaConfig(
            hidden_size=256,
            num_attention_heads=4,
            max_position_embeddings=256,
            rope_parameters=params,
        )
        kind = params["rope_type"]
        return (
            ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=length)
            if kind == "dynamic"
            else (ROPE_INIT_FUNCTIONS[kind](config, None))
        )

    def _ours(self, params: dict[str, Any]) -> Rope:
        config = {
            "model_type": "llama",
            "vocab_size": 512,
            "hidden_size": 256,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_parameters": params,
        }
        return spec_from_config(config).rope

    def test_tables_are_transformers(self) -> None:
        """linear, dynamic (at a length beyond the context) and yarn give transformers'
        inverse frequencies bit for bit, and yarn its attention factor."""
        cases = [
            {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ]
        for params in cases:
            with self.subTest(rope=params["rope_type"]):
                rope = self._ours(params)
                length = 1000 if params["rope_type"] == "dynamic" else None
                inv, factor = self._transformers(params, length)
                np.testing.assert_array_equal(_bits(rope.inv_freq(length)), _bits(inv))
                self.assertAlmostEqual(rope.attention_factor, factor, places=6)

    def test_llama3_table_is_transformers_within_an_ulp(self) -> None:
        """llama3's frequencies (as per-frequency divisors, the way a GGUF file holds them)
        are transformers' bit for bit outside the blended band and within 2 ulp inside it,
        and the blended band is not empty (the test would not see a wrong blend otherwise)."""
        params = dict(families.LLAMA3_ROPE)
        rope = self._ours(params)
        inv, _ = self._transformers(params)
        ours = rope.inv_freq().numpy()
        want = inv.numpy()
        factors = np.array(rope.freq_factors)
        blended = (factors != 1.0) & (factors != 8.0)
        self.assertGreater(int(blended.sum()), 0)
        np.testing.assert_array_equal(_bits(ours[~blended]), _bits(want[~blended]))
        gap = np.abs(_bits(ours[blended]).astype(np.int64) - _bits(want[blended]).astype(np.int64))
        self.assertLessEqual(int(gap.max()), 2)

    def test_a_tiny_models_own_rotary_table(self) -> None:
        """The llama family's table is the tiny Llama 3 model's own ``rotary_emb.inv_freq``
        (within 2 ulp in the blended band), and Gemma 3's sliding layers use their own base."""
        lm = families.model("llama")
        spec = read_folder(folder("llama")).spec
        theirs = lm.model.rotary_emb.inv_freq.numpy()
        gap = np.abs(_bits(spec.rope.inv_freq()).astype(np.int64) - _bits(theirs).astype(np.int64))
        self.assertLessEqual(int(gap.max()), 2)
        gemma = families.model("gemma3")
        gspec = read_folder(folder("gemma3")).spec
        local = gemma.model.rotary_emb.sliding_attention_inv_freq.numpy()
        np.testing.assert_array_equal(_bits(gspec.rope_of(0).inv_freq()), _bits(local))
        full = gemma.model.rotary_emb.full_attention_inv_freq.numpy()
        np.testing.assert_array_equal(_bits(gspec.rope_of(5).inv_freq()), _bits(full))

    def test_a_tables_rows_do_not_depend_on_its_length(self) -> None:
        """Every rope's tables (each family's, and linear, yarn and llama3 scaling) of 256
        positions are the first 256 rows of its tables of 32,768 bit for bit: the tables grow
        as the keys and values do (:class:`RopeTables`: the first 256 positions, then doubling,
        never beyond the window) and a step computes the same whatever length they have."""
        from sfnode.engines.runners.decoder import RopeTables, rope_tables

        ropes = {
            f"{family} layer {layer}": read_folder(folder(family)).spec.rope_of(layer)
            for family in families.FAMILY_NAMES
            for layer in (0, 5)
            if layer < read_folder(folder(family)).spec.layers
        }
        for params in (
            {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            dict(families.LLAMA3_ROPE),
        ):
            ropes[params["rope_type"]] = self._ours({"rope_theta": 10000.0, **params})
        for name, rope in ropes.items():
            with self.subTest(rope=name):
                short = rope_tables(rope, 256, torch.float32)
                long = rope_tables(rope, 32768, torch.float32)
                for few, many in zip(short, long, strict=True):
                    np.testing.assert_array_equal(_bits(few.numpy()), _bits(many[:256].numpy()))
        tables = RopeTables([ropes["linear"]] * 3, 1000, torch.float32)
        self.assertEqual(tables.length, 256)
        self.assertEqual(len({id(cos) for cos, _ in tables.layers}), 1)
        self.assertEqual(tables.cover(200)[0][0].shape[0], 256)
        self.assertEqual(tables.cover(300)[0][0].shape[0], 512)
        self.assertEqual(tables.cover(513)[0][0].shape[0], 1000)
        self.assertEqual(tables.cover(5000)[0][0].shape[0], 1000)


PROMPT = [1, 37, 90, 200, 15, 8, 301, 77]
TOKENS = 48


class ReferenceTests(unittest.SynchronousTestCase):
    """A forward in plain torch over the spec and the weights as stored
    (``tests/reference.py``) is transformers' model: the spec and the reader leave nothing
    out."""

    def _transformers(self, family: str, window: bool = True) -> Any:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(folder(family)))
        if not window:
            config.sliding_window = None
        model = AutoModelForCausalLM.from_pretrained(
            str(folder(family)), config=config, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()

    def test_folder_and_f32_gguf_are_transformers_generate(self) -> None:
        """For every family, the first 48 greedy tokens of the reference over the folder and
        over the F32 GGUF file equal transformers' ``generate()`` on the folder in float32
        (Mistral's GGUF file: equal to the model without its window, which the converter
        drops, and not to the windowed one, so the window matters here)."""
        from tests.reference import Reference

        for family in families.FAMILY_NAMES:
            with self.subTest(family=family):
                want = reference_greedy(self._transformers(family), PROMPT, TOKENS)
                self.assertEqual(len(want), TOKENS)
                self.assertGreater(len(set(want)), 8)
                self.assertEqual(
                    Reference(read_folder(folder(family))).greedy(PROMPT, TOKENS), want
                )
                from_file = Reference(read_gguf(gguf(family, "F32"))).greedy(PROMPT, TOKENS)
                if family == "mistral":
                    self.assertNotEqual(from_file, want)
                    unwindowed = self._transformers(family, window=False)
                    want = reference_greedy(unwindowed, PROMPT, TOKENS)
                self.assertEqual(from_file, want)

    def test_quantized_files_are_transformers_over_their_weights(self) -> None:
        """For every family, the reference over the Q8_0 and Q4_K_M files' blocks gives the
        first 48 greedy tokens of transformers' ``generate()`` on the folder's model with its
        matrices replaced by the file's (dequantized): the blocks, their rows and their names
        are read right."""
        from tests.reference import Reference, with_stored_matrices

        for family in families.FAMILY_NAMES:
            for kind in ("Q8_0", "Q4_K_M"):
                with self.subTest(family=family, kind=kind):
                    stored = read_gguf(gguf(family, kind))
                    model = self._transformers(family, window=family != "mistral")
                    want = reference_greedy(with_stored_matrices(model, stored), PROMPT, TOKENS)
                    self.assertEqual(Reference(stored).greedy(PROMPT, TOKENS), want)


class ChatTemplateTests(unittest.SynchronousTestCase):
    def test_template_from_folder_and_gguf(self) -> None:
        """The chat template comes from the model: the folder's ``chat_template.jinja`` and the
        GGUF file's ``tokenizer.chat_template`` give the family's tiny template."""
        from sfnode.engines.weights.templates import chat_template

        self.assertEqual(chat_template(folder("qwen3")), families.CHAT_TEMPLATE)
        self.assertEqual(chat_template(gguf("qwen3", "Q8_0")), families.CHAT_TEMPLATE)

    def test_tokenizer_config_and_no_template(self) -> None:
        """Without the jinja file the ``tokenizer_config.json``'s template is read (the
        ``default`` of named ones); a folder with neither has none (None, not an error)."""
        from sfnode.engines.weights.templates import chat_template

        bare = _root / "bare"
        bare.mkdir(exist_ok=True)
        self.assertIsNone(chat_template(bare))
        named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
        (bare / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
        self.assertEqual(chat_template(bare), "D")
        (bare / "tokenizer_config.json").write_text(json.dumps({"chat_template": "plain"}))
        self.assertEqual(chat_template(bare), "plain")
