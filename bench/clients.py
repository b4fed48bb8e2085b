"""The agent frameworks people use, against a real fleet: does each complete a tool call and a
typed (structured) output?  (docs/api.md; outside CI.)

Starts ``twistd sfnode`` on the bundled model and ``twistd sfhead`` dialing it, as deployed
(bench/_fleetproc.py), makes a virtualenv of its own for the clients (default
``/tmp/clients-venv``; torch is kept out of it by a pip constraint: clients need none) with the
``openai`` SDK, langchain-openai, pydantic-ai (``pydantic-ai-slim[openai]``), openai-agents and
instructor, and runs one small
script per framework in that venv against the head's ``/v1``.  Each script does two things the
way that framework's documentation shows:

- **tool call**: a function tool the model must call (``tool_choice`` required or the
  framework's equivalent), the call's arguments parsed by the framework;
- **typed output**: a pydantic model as the answer's type (``response_format`` /
  ``json_schema``, or the framework's structured-output mode), parsed by the framework.

Then prints a table: framework | tool call | typed output | notes.

    PYTHONPATH=. python bench/clients.py
    PYTHONPATH=. python bench/clients.py --venv /tmp/clients-venv --only openai,instructor

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # for tests.agents
import _fleetproc

PACKAGES = ["openai", "instructor", "langchain-openai", "pydantic-ai-slim[openai]", "openai-agents"]
"""pydantic-ai as its slim distribution with the OpenAI extra (the full one pulls every
provider's SDK).  instructor before the others: it caps ``openai`` lower than they need, and
installed last it would take ``openai`` back down under them (pip then warns of instructor's
cap, which its calls here do not hit)."""
NO_TORCH = "torch<0\n"
"""A pip constraint no torch release satisfies: installing a client that needs torch fails
instead of pulling a multi-gigabyte build."""

COMMON = '''
import json, os, sys, traceback
from typing import Literal
import pydantic

BASE = os.environ["SFNODE_BASE"]
MODEL = os.environ["SFNODE_MODEL"]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    country: Literal["France", "Germany", "Italy", "Spain", "Other"]
    population_millions: int = pydantic.Field(ge=0, le=40)


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return f"18 degrees {unit} in {city}"


WEATHER = json.loads(os.environ["SFNODE_WEATHER_TOOL"])
ASK_TOOL = "What is the weather in Paris? Use the tool."
ASK_TYPED = "Describe Paris."
result = {"tool": None, "typed": None, "notes": []}


def attempt(kind, work):
    try:
        result[kind] = work()
    except Exception as e:
        result[kind] = False
        result["notes"].append(f"{kind}: {type(e).__name__}: {str(e)[:160]}")
        traceback.print_exc()
'''

SCRIPTS = {
    "openai": '''
import openai
client = openai.OpenAI(base_url=BASE, api_key="-")

def tool():
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK_TOOL}], tools=[WEATHER],
        tool_choice="required", max_tokens=256)
    call = answer.choices[0].message.tool_calls[0]
    json.loads(call.function.arguments)
    result["notes"].append(f"called {call.function.name}({call.function.arguments})")
    return call.function.name == "get_weather"

def typed():
    answer = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": ASK_TYPED}], response_format=City,
        max_tokens=256)
    parsed = answer.choices[0].message.parsed
    result["notes"].append(f"parse -> {parsed!r}")
    return isinstance(parsed, City)

attempt("tool", tool)
attempt("typed", typed)
''',
    "langchain-openai": '''
from langchain_openai import ChatOpenAI
from langchain_core.tools import tool as lc_tool

llm = ChatOpenAI(model=MODEL, base_url=BASE, api_key="-", max_tokens=256)

def tool():
    weather = lc_tool(get_weather)
    answer = llm.bind_tools([weather], tool_choice="get_weather").invoke(ASK_TOOL)
    call = answer.tool_calls[0]
    result["notes"].append(f"bind_tools -> {call['name']}({call['args']})")
    return call["name"] == "get_weather" and isinstance(call["args"], dict)

def typed():
    parsed = llm.with_structured_output(City, method="json_schema").invoke(ASK_TYPED)
    result["notes"].append(f"with_structured_output -> {parsed!r}")
    return isinstance(parsed, City)

attempt("tool", tool)
attempt("typed", typed)
''',
    "pydantic-ai": '''
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE, api_key="-"))
settings = ModelSettings(max_tokens=256)
calls = []

def tool():
    agent = Agent(model, model_settings=settings)

    @agent.tool_plain
    def weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        calls.append((city, unit))
        return get_weather(city, unit)

    run = agent.run_sync(ASK_TOOL)
    result["notes"].append(f"tool called with {calls}; answer {str(run.output)[:60]!r}")
    return bool(calls)

def typed():
    agent = Agent(model, output_type=City, model_settings=settings)
    run = agent.run_sync(ASK_TYPED)
    result["notes"].append(f"output_type -> {run.output!r}")
    return isinstance(run.output, City)

attempt("tool", tool)
attempt("typed", typed)
''',
    "openai-agents": '''
from openai import AsyncOpenAI
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)

set_tracing_disabled(True)
model = OpenAIResponsesModel(MODEL, AsyncOpenAI(base_url=BASE, api_key="-"))
calls = []

@function_tool
def weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    calls.append((city, unit))
    return get_weather(city, unit)

def tool():
    agent = Agent(name="w", instructions="Answer with the tool.", model=model, tools=[weather],
                  model_settings=ModelSettings(tool_choice="required", max_tokens=256,
                                               parallel_tool_calls=False),
                  tool_use_behavior="stop_on_first_tool")
    run = Runner.run_sync(agent, ASK_TOOL)
    result["notes"].append(f"/v1/responses: tool called with {calls}")
    return bool(calls)

def typed():
    agent = Agent(name="c", instructions="Describe the city.", model=model, output_type=City,
                  model_settings=ModelSettings(max_tokens=256))
    run = Runner.run_sync(agent, ASK_TYPED)
    result["notes"].append(f"output_type -> {run.final_output!r}")
    return isinstance(run.final_output, City)

attempt("tool", tool)
attempt("typed", typed)
''',
    "instructor": '''
import instructor
import openai

raw = openai.OpenAI(base_url=BASE, api_key="-")

def parsed_in(mode):
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    parsed = client.chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, max_tokens=256,
        messages=[{"role": "user", "content": ASK_TYPED}])
    result["notes"].append(f"Mode.{mode} -> {parsed!r}")
    return isinstance(parsed, City)

attempt("tool", lambda: parsed_in("TOOLS"))
attempt("typed", lambda: parsed_in("JSON_SCHEMA"))
''',
}
TAIL = '''
print("RESULT " + json.dumps(result))
'''


def make_venv(venv: Path, packages: list[str]) -> Path:
    """A venv with ``packages`` (torch refused by the constraint); its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraint = venv / "no-torch.txt"
    constraint.write_text(NO_TORCH)
    # One at a time: resolving the five together sends pip's resolver into a long backtrack
    # (their pins on openai and httpx differ); each alone installs in seconds.
    for package in packages:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--constraint", str(constraint),
             package],
            check=True,
        )  # fmt: skip
    return python


def run_client(python: Path, name: str, base: str, model: str, logs: Path) -> dict[str, object]:
    script = logs / f"client-{name}.py"
    script.write_text(textwrap.dedent(COMMON) + textwrap.dedent(SCRIPTS[name]) + TAIL)
    from tests.agents import TOOLS

    # The weather tool the agent tests use (tests/agents.py), handed to the client's script.
    env = {
        **_fleetproc.SHELL_ENV,
        "SFNODE_BASE": base,
        "SFNODE_MODEL": model,
        "SFNODE_WEATHER_TOOL": json.dumps(TOOLS[0]),
    }
    done = subprocess.run(
        [str(python), str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    (logs / f"client-{name}.log").write_text(done.stdout + done.stderr)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            found: dict[str, object] = json.loads(line[len("RESULT ") :])
            return found
    return {"tool": None, "typed": None, "notes": [f"no result (exit {done.returncode})"]}


def mark(value: object) -> str:
    return "yes" if value is True else "no" if value is False else "not run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/clients-venv"))
    parser.add_argument("--only", default=",".join(SCRIPTS), help="frameworks, comma-separated")
    parser.add_argument("--node-arg", action="append", default=[], help="more sfnode options")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    _fleetproc.guard_children()
    python = make_venv(args.venv, PACKAGES)
    versions = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True
    )
    installed = {p["name"].lower(): p["version"] for p in json.loads(versions.stdout)}
    logs = Path(tempfile.mkdtemp(prefix="sfnode-clients-"))
    env = _fleetproc.child_env([])
    rows = []
    with _fleetproc.fleet_processes(args.node_arg, env, None, logs) as port:
        model = _fleetproc.served_model(port)
        base = f"http://127.0.0.1:{port}/v1"
        for name in names:
            print(f"running {name} ...", flush=True)
            found = run_client(python, name, base, model, logs)
            rows.append((name, found))
    print()
    print(f"clients venv {args.venv}; logs in {logs}")
    print("| framework | tool call | typed output | notes |")
    print("|---|---|---|---|")
    for name, found in rows:
        version = installed.get(name) or installed.get(name + "-slim", "?")
        notes = "; ".join(str(n) for n in found.get("notes", []))  # type: ignore[attr-defined]
        notes = notes.replace("|", "/").replace("\n", " ")
        print(f"| {name} {version} | {mark(found['tool'])} | {mark(found['typed'])} | {notes} |")


if __name__ == "__main__":
    main()
