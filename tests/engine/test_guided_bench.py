"""`kvplane bench guided --quick` runs end to end and reports every figure."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvplane.cli import app


@pytest.mark.timeout(120)
def test_bench_guided_reports_mask_compile_and_sampler_costs() -> None:
    result = CliRunner().invoke(app, ["bench", "guided", "--quick", "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    vocabularies = {v["name"]: v for v in doc["vocabularies"]}
    assert "builtin" in vocabularies and "bpe-32k" not in vocabularies  # --quick
    builtin = vocabularies["builtin"]
    assert builtin["tokens"] > 256 and builtin["trie_nodes"] >= builtin["tokens"]
    cases = {c["case"]: c for c in builtin["cases"]}
    # After '123-ab' the regex [0-9]{3}-[a-z]+ allows lowercase letters and EOS only.
    assert 0 < cases["regex after '123-ab'"]["allowed"] < builtin["tokens"]
    assert cases["choice of 4 at the start"]["allowed"] >= 3  # y, n, m (or longer tokens)
    for case in cases.values():
        assert case["first_visit_ms"] > 0 and case["repeat_visit_ms"] >= 0
    assert cases["ebnf json in a string"]["first_visit_cold_ms"] > 0
    compiled = {c["guide"]: c for c in doc["compile"]}
    assert compiled["regex [0-9]{3}-[a-z]+"]["dfa_states"] > 3
    assert compiled["ebnf_grammar (json)"]["bnf_productions"] > 7
    assert [r["allowed"] for r in doc["sampler"]] == [None, 10, 16000]
