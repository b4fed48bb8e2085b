"""The bundled default model end to end: real ``twistd sfnode`` (and ``twistd sfhead``)
processes on SmolLM2.

These are the slow tests of the node on the real default model: the node converts the bundled
GGUF into its cache if it has to (tens of seconds the first time).

- A head-side link asks a node, with the model's own chat template rendered here, for the
  capital of France (issue 3).
- Through a fleet, the ``openai`` package's seeded requests (temperature 0.8) with prompts of
  several KV blocks give the same text when sent again, the prefix cache on in the default
  weights mode: the repeat reads the prompt's KV from the cache (docs/engine.md section 4).

They run in CI; locally ``SFNODE_SKIP_SLOW=1`` skips them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor, threads
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, readBody

from sfnode.engines.weights.loading import load_tokenizer
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, connect_node
from sfnode.linkf.wire import FINISH_EOS, FINISH_LENGTH
from tests.bundled import BUNDLED_MODEL_SKIP
from tests.clients import openai_client
from tests.processes import LOOPBACK, Child, loopback_head, node_endpoint, spawn_twistd, spawner


class BundledModelProcessTests(TestCase):
    skip = BUNDLED_MODEL_SKIP
    timeout = 600

    async def test_capital_of_france(self) -> None:
        """A real ``twistd -n sfnode`` on the default model (no --model) answers a chat prompt
        asking for the capital of France, rendered with SmolLM2's chat template by the test,
        with "Paris" in the detokenized greedy output."""
        node = spawn_twistd(
            self, Child("sfnode"), ["sfnode", "--listen", LOOPBACK, "--threads", "2"]
        )
        (bound,) = await node.wait_for(rb"sfnode listening on 127\.0\.0\.1:(\d+)\n")
        port = int(bound.group(1))
        tokenizer = load_tokenizer(None)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        self.addCleanup(link.close)
        self.assertEqual(link.models, ("SmolLM2-135M-Instruct",))
        link.assign(1)
        link.append(1, list(prompt))
        outcome = await link.generate(1, HeadRequest((), 16)).result
        self.assertIn(outcome.finish, (FINISH_EOS, FINISH_LENGTH))
        answer = tokenizer.decode(outcome.tokens, skip_special_tokens=True)
        self.assertIn("Paris", answer)

    async def test_seeded_requests_repeat_with_the_prefix_cache_on(self) -> None:
        """Through twistd sfhead and twistd sfnode on the default model (default weights, the
        prefix cache on), each of four seeded chat requests (temperature 0.8, prompts of
        several 16-token blocks) sent with the openai package gives the same text when sent
        again, and the repeats reused their prompts' blocks (the node's /metrics)."""
        node = spawn_twistd(
            self,
            Child("sfnode"),
            ["sfnode", "--listen", LOOPBACK, "--threads", "2", "--metrics", LOOPBACK],
        )
        endpoint = await node_endpoint(node)
        (metrics,) = await node.wait_for(rb"sfnode metrics on 127\.0\.0\.1:(\d+)\n")
        (checked,) = await node.wait_for(rb"(checked|depends on how its prompt was cut)")
        self.assertEqual(checked.group(1), b"checked", "the start-up check of exactness warned")
        head, base = await loopback_head(spawner(self), nodes=[endpoint])
        await head.wait_for(rb"node \S+ joined")
        client = openai_client(self, f"{base}/v1", api_key="-")
        topics = ("a lighthouse keeper", "a city under the sea", "two rival bakers", "a storm")
        questions = [
            f"Write the opening of a short story about {topic}. Describe the place, the weather, "
            "the people who live there and what they fear, in plain words, in a few sentences."
            for topic in topics
        ]

        def ask(question: str, seed: int) -> Any:
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": question}],
                max_tokens=24,
                temperature=0.8,
                seed=seed,
            )

        async def reused_tokens() -> float:
            url = f"http://127.0.0.1:{int(metrics.group(1))}/metrics"
            text = (await readBody(await Agent(reactor).request(b"GET", url.encode()))).decode()
            samples = {
                sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }
            return samples["sfnode_prefix_cache_reused_tokens_total"]

        for seed, question in enumerate(questions, start=11):
            first = await threads.deferToThread(ask, question, seed)
            self.assertGreater(first.usage.prompt_tokens, 3 * 16)
            before = await reused_tokens()
            again = await threads.deferToThread(ask, question, seed)
            self.assertGreaterEqual(await reused_tokens() - before, 3 * 16)
            self.assertEqual(again.choices[0].message.content, first.choices[0].message.content)
