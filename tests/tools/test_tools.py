"""Tool-call parsing, the shipped tools and interaction, the Python sandbox's limits, and the config
loaders."""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

from klppo.tools.calculator import CalculatorTool, evaluate
from klppo.tools.config import load_interactions, load_tools
from klppo.tools.gsm8k import Gsm8kInteraction, Gsm8kTool
from klppo.tools.parsing import parse_hermes, truncate
from klppo.tools.python_exec import PythonTool, run_python


def run(coro):
    return asyncio.run(coro)


def test_hermes_calls_and_malformed_ones():
    text = (
        'think <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "g"'
    )
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "1+2"}, True),
        ("f", {"x": 1}, True),
    ]
    assert all(c.error for c in calls[2:]) and len(calls) == 5
    assert "without its closing" in calls[-1].error
    assert parse_hermes("no calls here") == []


def test_truncate_sides_follow_verl():
    assert truncate("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert truncate("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert truncate("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert truncate("abc", 4, "middle") == "abc"


def test_calculator():
    assert evaluate("(3+4)*12") == 84 and evaluate("-2**3") == -8
    tool = CalculatorTool()
    assert run(tool.execute("i", {"expression": "7/2"}))[0].text == "3.5"
    for bad in ("__import__('os')", "2**1000", "1/0", "x+1"):
        assert run(tool.execute("i", {"expression": bad}))[0].text.startswith("error:")
    assert run(tool.execute("i", {}))[0].text.startswith("error:")


def test_gsm8k_tool_and_interaction():
    tool = Gsm8kTool()
    iid, _ = run(tool.create(create_kwargs={"ground_truth": "19"}))
    assert run(tool.execute(iid, {"answer": "18"}))[1] == -0.05
    assert run(tool.execute(iid, {"answer": "19"}))[1] == 0.0
    assert run(tool.calc_reward(iid)) == 1.0
    run(tool.release(iid))
    inter = Gsm8kInteraction({"name": "gsm8k"})
    iid = run(inter.start_interaction(None, ground_truth="19"))
    done, text, score, _ = run(inter.generate_response(iid, [{"role": "assistant", "content": "#### 5"}]))
    assert (done, score) == (False, 0.0) and "try again" in text
    done, _, score, _ = run(inter.generate_response(iid, [{"role": "assistant", "content": "#### 19"}]))
    assert (done, score) == (True, 1.0)


def test_the_interaction_checks_free_text_answers_with_the_flexible_rule():
    """``method: flexible`` (the arithmetic retry's config): the last number is the answer, a negative one
    included, as the flexible reward reads it; strict asks for ``#### N``."""
    texts = ["23 - 45 = -22", "so the answer is -23"]
    for method, verdicts in (("flexible", [True, False]), ("strict", [False, False])):
        inter = Gsm8kInteraction({"method": method})
        iid = run(inter.start_interaction(None, ground_truth="-22"))
        got = [run(inter.generate_response(iid, [{"role": "assistant", "content": t}]))[0] for t in texts]
        assert got == verdicts
    with pytest.raises(ValueError, match="config.method='loose'; known: strict, flexible"):
        Gsm8kInteraction({"method": "loose"})


def test_python_sandbox_limits(tmp_path):
    out, status, timed_out = run(run_python("import os; print(os.getcwd()); open('f', 'w').write('x')"))
    assert status == 0 and not timed_out and not os.path.exists(out.strip())  # its temp dir is gone
    assert run(run_python("while True: pass", timeout_s=0.5))[2]
    out, status, _ = run(run_python("x = bytearray(1 << 31)", memory_limit_mb=256))
    assert status != 0 and "MemoryError" in out
    out, status, _ = run(run_python("import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)"))
    assert status != 0 and ("OSError" in out or "unreachable" in out)
    out, status, _ = run(run_python("import os; print(sorted(os.environ))"))
    assert "PATH" in out and "PYTHONPATH" not in out
    assert run(run_python("print('x' * 10000)", max_output_chars=100))[0].endswith(
        "(output cut at 100 characters)"
    )
    response, _, metrics = run(PythonTool({"timeout_s": 5}).execute("i", {"code": "raise SystemExit(3)"}))
    assert "exit status 3" in response.text and metrics["error"] == 1


def test_configs_load_map_and_refuse(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        textwrap.dedent("""
        tools:
          - class_name: verl.tools.gsm8k_tool.Gsm8kTool
            config: {type: native}
            tool_schema:
              type: function
              function: {name: calc_gsm8k_reward, description: check,
                         parameters: {type: object, properties: {}}}
          - class_name: klppo.tools.calculator.CalculatorTool
    """)
    )
    loaded = load_tools(str(tools))
    assert sorted(loaded) == ["calc_gsm8k_reward", "calculator"] and isinstance(
        loaded["calc_gsm8k_reward"], Gsm8kTool
    )
    inter = tmp_path / "inter.yaml"
    inter.write_text(
        "interaction:\n  - name: gsm8k\n    class_name: "
        "verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
    )
    assert isinstance(load_interactions(str(inter))["gsm8k"], Gsm8kInteraction)
    for class_name, words in [
        ("verl.tools.search_tool.SearchTool", "retrieval"),
        ("verl.tools.sandbox_fusion_tools.SandboxFusionTool", "SandboxFusion"),
        ("verl.tools.new_tool.NewTool", "not supported: klppo has no equivalent"),
        ("no.such.Module", "cannot import"),
        ("builtins.dict", "not a BaseTool"),
    ]:
        tools.write_text(f"tools:\n  - class_name: {class_name}\n")
        with pytest.raises(ValueError, match=words):
            load_tools(str(tools))
    with pytest.raises(ValueError, match="not found"):
        load_tools(str(tmp_path / "missing.yaml"))
