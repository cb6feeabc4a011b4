"""Guided decoding over gRPC on the torch runner (the builtin random model, real sampler): every
output of a random model matches its constraint, greedy and sampled; unguided requests in the
same batch are unaffected; refusals and capabilities."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.api import GuidedDecoding, GuideKind
from engine.core.guided import Guide, GuideState, compile_guide
from engine.core.guided_json import JsonObjectGuide
from engine.torch_runner.builtin_model import EOS_ID, build_tokenizer, ensure_builtin_model
from openengine.v1 import openengine_pb2 as pb
from tests.engine.engine_server_harness import (
    Engine,
    collect,
    rpc_error,
    running_engine,
    sim_config,
    stream_error,
    torch_config,
)
from vllm_grpc import vllm_grpc_pb2 as vpb

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(20, 44))
SEEDS = (1, 2, 3)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "ok": {"type": "null"}},
            "required": ["x"],
        },
    },
    "required": ["id", "color", "point"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("models"))


def _config(model_dir: Path) -> EngineConfig:
    return torch_config(str(model_dir), served_model_name="m")


def _request(
    guided: pb.GuidedDecoding | None,
    *,
    seed: int | None = None,
    max_tokens: int = 200,
    rid: str = "",
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=rid,
        model="m",
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=0.0 if seed is None else 1.0),
        stopping=pb.StoppingOptions(max_tokens=max_tokens),
    )
    if seed is not None:
        request.sampling.seed = seed
    if guided is not None:
        request.guided.CopyFrom(guided)
    return request


def _result(responses: list[pb.GenerateResponse]) -> tuple[str, list[int], pb.GenerationFinished]:
    text = "".join(r.token.text for r in responses if r.WhichOneof("event") == "token")
    tokens = [r.token for r in responses if r.WhichOneof("event") == "token"]
    ids = [t.token_id for token in tokens for t in token.tokens]
    finished = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
    assert len(finished) == 1, responses[-1]
    return text, ids, finished[0]


async def _outputs(engine: Engine, guided: pb.GuidedDecoding, **kw: Any) -> list[str]:
    """Greedy and sampled (several seeds) outputs, all ended by EOS."""
    requests = [_request(guided, **kw)] + [_request(guided, seed=s, **kw) for s in SEEDS]
    texts = []
    for responses in await asyncio.gather(*(collect(engine.stub, r) for r in requests)):
        text, _, finished = _result(responses)
        assert finished.reason == pb.FINISH_REASON_STOP, (text, finished)
        assert finished.stop_match.WhichOneof("match") == "eos_token_id"
        texts.append(text)
    return texts


def _check_schema(value: Any) -> None:
    """SCHEMA, by hand."""
    assert isinstance(value, dict)
    assert set(value) <= set(SCHEMA["properties"]) and {"id", "color", "point"} <= set(value)
    assert list(value) == [k for k in SCHEMA["properties"] if k in value]  # schema order
    assert type(value["id"]) is int
    assert value["color"] in ("red", "green", "blue")
    if "name" in value:
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
    if "tags" in value:
        assert len(value["tags"]) <= 3 and all(type(t) is bool for t in value["tags"])
    point = value["point"]
    assert isinstance(point, dict) and set(point) <= {"x", "ok"} and "x" in point
    assert type(point["x"]) in (int, float) and point.get("ok") is None


async def test_outputs_match_each_constraint_greedy_and_sampled(model_dir: Path) -> None:
    async with running_engine(_config(model_dir)) as engine:
        pattern = r"[0-9]{3}-[a-z]{1,4}"
        texts = await _outputs(engine, pb.GuidedDecoding(regex=pattern))
        assert all(re.fullmatch(pattern, t) for t in texts), texts

        choices = ["apple", "apricot", "banana", "ü-ber"]
        choice = pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=choices))
        texts = await _outputs(engine, choice)
        assert all(t in choices for t in texts), texts

        schema = pb.GuidedDecoding(json_schema=json.dumps(SCHEMA), backend="kvplane")
        for text in await _outputs(engine, schema, max_tokens=400):
            _check_schema(json.loads(text))


async def test_unicode_characters_split_across_byte_tokens_are_allowed(model_dir: Path) -> None:
    """The builtin vocabulary spells most non-ASCII characters with one token per byte: a
    token that ends inside a character is allowed when some character it starts continues
    the text ("ü" is C3 BC, "日" E6 97 A5: no fixed list of completions names them)."""
    choices = ["ü", "日本", "ñandú"]
    pattern = "[à-ÿ]{2}日本?"
    async with running_engine(_config(model_dir)) as engine:
        choice = pb.GuidedDecoding(choice=pb.ChoiceConstraint(choices=choices))
        assert all(t in choices for t in await _outputs(engine, choice, max_tokens=40))
        texts = await _outputs(engine, pb.GuidedDecoding(regex=pattern), max_tokens=40)
        assert all(re.fullmatch(pattern, t) for t in texts), texts


async def _ended_or_cut(
    model_dir: Path,
    guided: pb.GuidedDecoding,
    guide: Guide,
    check: Callable[[str], object],
    *,
    temperatures: list[float],
    max_tokens: int,
) -> int:
    """A greedy request cut at 60 tokens and one sampled request per temperature (seeds 1,
    2, ...): an output that ends STOP (by EOS) passes `check`, one cut by max_tokens (LENGTH)
    is a prefix the guide accepts. Returns how many ended STOP."""
    requests = [_request(guided, max_tokens=60)]
    for seed, temperature in enumerate(temperatures, start=1):
        requests.append(_request(guided, seed=seed, max_tokens=max_tokens))
        requests[-1].sampling.temperature = temperature
    async with running_engine(_config(model_dir)) as engine:
        results = await asyncio.gather(*(collect(engine.stub, r) for r in requests))
    num_complete = 0
    for responses in results:
        text, _, finished = _result(responses)
        if finished.reason == pb.FINISH_REASON_STOP:
            assert finished.stop_match.WhichOneof("match") == "eos_token_id"
            assert check(text) is not False, text
            num_complete += 1
        else:
            assert finished.reason == pb.FINISH_REASON_LENGTH, (text, finished)
            state: GuideState | None = guide.start()
            for char in text:
                assert state is not None, text
                state = guide.advance(state, char)
            assert state is not None, text
    return num_complete


async def test_json_object_outputs_are_objects_or_cut_prefixes(model_dir: Path) -> None:
    """A random model rarely closes a JSON string (a quote is a few tokens of the vocabulary),
    so a near-uniform temperature lets it finish; greedy is cut by max_tokens."""
    json_object = pb.GuidedDecoding(json_object=pb.JsonObjectConstraint())
    num_complete = await _ended_or_cut(
        model_dir,
        json_object,
        JsonObjectGuide(),
        lambda text: isinstance(json.loads(text), dict),
        temperatures=[1000.0] * 6,
        max_tokens=1000,
    )
    assert num_complete >= 2


EBNF_GRAMMARS = {
    # Nested parentheses: not a regular language.
    "arithmetic": """root ::= expr
        expr ::= term (("+" | "-") term)*
        term ::= factor ("*" factor)*
        factor ::= [0-9]{1,3} | "(" expr ")" """,
    "json-like": r"""root ::= object
        value ::= object | array | string | [0-9]+ | "true" | "false" | "null"
        object ::= "{" ( pair ("," pair)* )? "}"
        pair ::= string ":" value
        array ::= "[" ( value ("," value)* )? "]"
        string ::= "\"" [a-z]{0,4} "\"" """,
    "yes/no list": 'root ::= answer ("," " "? answer)* "."\nanswer ::= "yes" | "no"',
}


def _check_ebnf(name: str, text: str) -> None:
    """Each grammar's language, by hand (independently of the guide)."""
    if name == "arithmetic":
        assert re.fullmatch(r"[0-9()+\-*]+", text), text
        depth = 0
        for char in text:
            depth += {"(": 1, ")": -1}.get(char, 0)
            assert depth >= 0, text
        assert depth == 0, text
        flat = text
        while "(" in flat:  # innermost groups, each a flat expression, become a number
            flat, n = re.subn(r"\((?:[0-9]+[+\-*])*[0-9]+\)", "0", flat)
            assert n, text
        assert re.fullmatch(r"(?:[0-9]+[+\-*])*[0-9]+", flat), text
    elif name == "json-like":
        value = json.loads(text)
        assert isinstance(value, dict), text
        assert ": " not in text and ", " not in text  # no whitespace in this grammar
    else:
        assert re.fullmatch(r"(?:yes|no)(?:, ?(?:yes|no))*\.", text), text


@pytest.mark.parametrize("name", list(EBNF_GRAMMARS))
async def test_ebnf_outputs_are_in_the_grammar_or_cut_prefixes(model_dir: Path, name: str) -> None:
    """Greedy and sampled (a near-uniform temperature lets a random model close what it
    opens): outputs that end STOP are in the language, those cut by max_tokens (LENGTH) are
    prefixes the guide accepts."""
    grammar = EBNF_GRAMMARS[name]
    num_complete = await _ended_or_cut(
        model_dir,
        pb.GuidedDecoding(ebnf_grammar=grammar),
        compile_guide(GuidedDecoding(GuideKind.EBNF_GRAMMAR, grammar)),
        lambda text: _check_ebnf(name, text),
        temperatures=[1.0] * 3 + [1000.0] * 3,
        max_tokens=300,
    )
    assert num_complete >= 2, name


async def test_unguided_requests_in_the_batch_are_unaffected(model_dir: Path) -> None:
    async with running_engine(_config(model_dir)) as engine:
        plain = [_request(None, max_tokens=24, rid="p0"), _request(None, seed=7, rid="p1")]
        plain[1].stopping.max_tokens = 24
        alone = [_result(await collect(engine.stub, r))[1] for r in plain]
        guided = _request(pb.GuidedDecoding(regex="[a-z ]+"), seed=3, max_tokens=24, rid="g")
        mixed = await asyncio.gather(*(collect(engine.stub, r) for r in [guided, *plain]))
        assert [_result(m)[1] for m in mixed[1:]] == alone
        text, _, _ = _result(mixed[0])
        assert re.fullmatch("[a-z ]*", text)


async def test_max_tokens_cuts_a_guided_output_with_length(model_dir: Path) -> None:
    async with running_engine(_config(model_dir)) as engine:
        guided = pb.GuidedDecoding(regex="[0-9]{3}-[a-z]+")
        text, ids, finished = _result(await collect(engine.stub, _request(guided, max_tokens=2)))
        assert finished.reason == pb.FINISH_REASON_LENGTH and len(ids) == 2
        assert re.fullmatch(r"[0-9]{0,3}-?[a-z]*", text)


async def test_a_guide_that_cannot_continue_ends_with_one_invalid_argument(model_dir: Path) -> None:
    async with running_engine(_config(model_dir)) as engine:
        # "a" is complete and nothing extends it, but ignore_eos forbids EOS: after "a" no
        # token is allowed.
        request = _request(pb.GuidedDecoding(regex="a"), max_tokens=8, rid="dead")
        request.stopping.ignore_eos = True
        responses = await collect(engine.stub, request)
        assert [r.WhichOneof("event") for r in responses][-1] == "error"
        assert "guided decoding" in responses[-1].error.message
        # The request's constraint failed, not the engine: the client's error, not retryable.
        assert responses[-1].error.code == pb.ERROR_CODE_INVALID_ARGUMENT
        assert not responses[-1].error.retryable
        assert responses[-1].HasField("usage")


async def test_an_eos_id_that_is_an_ordinary_token_is_never_text(
    model_dir: Path, tmp_path: Path
) -> None:
    # A model may end on a token the tokenizer does not mark special: here "x". The guide
    # must not offer it as text (sampling it ends the output, the text unfinished).
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    x_id = build_tokenizer().token_to_id("x")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, x_id]}))
    async with running_engine(torch_config(str(model), served_model_name="m")) as engine:
        either = pb.GuidedDecoding(regex="(x|y)y")  # "x" would be EOS, never text: "yy"
        assert await _outputs(engine, either) == ["yy"] * (1 + len(SEEDS))
        # "xy" cannot be written without "x": no token continues, the guided error.
        responses = await collect(engine.stub, _request(pb.GuidedDecoding(regex="xy")))
        assert [r.WhichOneof("event") for r in responses][-1] == "error"
        assert "guided decoding" in responses[-1].error.message


@pytest.mark.parametrize(
    ("guided", "needle"),
    [
        (pb.GuidedDecoding(ebnf_grammar="root ::= 'a'"), 'unexpected "\'" at line 1'),
        (pb.GuidedDecoding(ebnf_grammar='root ::= "a" b'), "undefined rule 'b'"),
        (pb.GuidedDecoding(ebnf_grammar='item ::= "a"'), "no rule named 'root'"),
        (pb.GuidedDecoding(structural_tag="{}"), "not supported"),
        (pb.GuidedDecoding(regex="[a-", backend=""), "invalid pattern"),
        (pb.GuidedDecoding(regex="a(?=b)"), "lookahead"),
        (pb.GuidedDecoding(regex=r"(a)\1"), "backreference"),
        (pb.GuidedDecoding(regex="[ab]{20000}"), "too many states"),
        (pb.GuidedDecoding(regex="a", backend="xgrammar"), "backend"),
        (pb.GuidedDecoding(choice=pb.ChoiceConstraint()), "empty"),
        (pb.GuidedDecoding(json_schema="{"), "not valid JSON"),
        (pb.GuidedDecoding(json_schema='{"type": "string", "pattern": "a"}'), "'pattern'"),
        (pb.GuidedDecoding(json_schema='{"anyOf": []}'), "keyword 'anyOf'"),
        (  # a malformed `required` is the request's error, not the engine's
            pb.GuidedDecoding(
                json_schema='{"type": "object", "properties": {}, "required": [["a"]]}'
            ),
            "malformed properties",
        ),
        (  # nested arrays double the pattern per level (2^19 times the item)
            pb.GuidedDecoding(
                json_schema='{"type": "array", "items": ' * 19 + '{"type": "null"}' + "}" * 19
            ),
            "is too large",
        ),
        (
            pb.GuidedDecoding(
                json_schema='{"type": "object", "properties": {"a": ' * 350
                + '{"type": "null"}'
                + '}, "required": ["a"]}' * 350
            ),
            "nests too deeply",
        ),
        (pb.GuidedDecoding(), "set one of"),
    ],
)
async def test_refusals_are_invalid_argument(
    model_dir: Path, guided: pb.GuidedDecoding, needle: str
) -> None:
    async with running_engine(_config(model_dir)) as engine:
        request = _request(guided)
        request.guided.CopyFrom(guided)  # an empty GuidedDecoding still sets the field
        _, error = await stream_error(engine.stub.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (error.details() or ""), error.details()


async def test_vllm_structured_output_maps_to_the_same_guides(model_dir: Path) -> None:
    async with running_engine(_config(model_dir)) as engine:
        request = vpb.GenerateRequest(
            model="m",
            token_ids=vpb.TokenIds(ids=PROMPT),
            decoding=vpb.DecodingParameters(regex="[0-9]{2}x"),
            stopping=vpb.StoppingCriteria(max_new_tokens=16),
        )
        response = await engine.vllm.Generate(request)
        assert re.fullmatch("[0-9]{2}x", response.outputs.text), response
        request.decoding.grammar = 'root ::= [0-9] [0-9] "x"'
        response = await engine.vllm.Generate(request)
        assert re.fullmatch("[0-9]{2}x", response.outputs.text), response
        choices = ["apple", "apricot", "banana"]
        request.decoding.choice.choices.extend(choices)
        response = await engine.vllm.Generate(request)
        assert response.outputs.text in choices, response
        request.decoding.json = json.dumps(SCHEMA)
        request.stopping.max_new_tokens = 400
        response = await engine.vllm.Generate(request)
        assert response.outputs.finish_info.HasField("eos_token_id"), response
        _check_schema(json.loads(response.outputs.text))
        request.decoding.json_object = True
        response = await engine.vllm.Generate(request)
        assert response.outputs.text.startswith("{"), response
        # json_object = false is no constraint (vLLM's reading): the unguided output.
        request.decoding.json_object = False
        unguided = vpb.GenerateRequest()
        unguided.CopyFrom(request)
        unguided.ClearField("decoding")
        assert (await engine.vllm.Generate(request)).outputs.text == (
            await engine.vllm.Generate(unguided)
        ).outputs.text
        request.stopping.max_new_tokens = 16
        request.decoding.grammar = "root ::= 'a'"
        error = await rpc_error(engine.vllm.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        request.decoding.structural_tag = "{}"
        error = await rpc_error(engine.vllm.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A guide with no possible token fails the request, not the engine.
        request.decoding.regex = "a"
        request.stopping.ignore_eos = True
        error = await rpc_error(engine.vllm.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "guided decoding" in (error.details() or "")


async def test_vllm_allowed_token_ids_narrow_a_guide(model_dir: Path) -> None:
    """vLLM's allow-list applies on top of the guide: without the tokens holding a "k", only
    "banana" can be written; without EOS too, the finished guide is a dead end."""
    tokenizer = build_tokenizer()
    no_k = [i for i in range(tokenizer.get_vocab_size()) if "k" not in tokenizer.decode([i])]
    async with running_engine(_config(model_dir)) as engine:
        request = vpb.GenerateRequest(
            model="m",
            token_ids=vpb.TokenIds(ids=PROMPT),
            temperature=1.0,
            decoding=vpb.DecodingParameters(
                choice=vpb.DecodingParameters.StringChoices(choices=["kiwi", "banana"]),
                allowed_token_ids=no_k,
            ),
            stopping=vpb.StoppingCriteria(max_new_tokens=16),
        )
        for seed in SEEDS:
            request.sampling.seed = seed
            response = await engine.vllm.Generate(request)
            assert response.outputs.text == "banana", response
            assert response.outputs.finish_info.HasField("eos_token_id"), response
        request.decoding.allowed_token_ids.remove(EOS_ID)  # "banana" cannot end
        error = await rpc_error(engine.vllm.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The allow-list is named: neither min_tokens nor ignore_eos forbids ending it.
        assert "guided decoding: allowed_token_ids" in (error.details() or ""), error.details()


async def test_capabilities_advertise_exactly_the_modes(model_dir: Path) -> None:
    async with running_engine(_config(model_dir)) as engine:
        caps = (await engine.stub.GetModelInfo(pb.GetModelInfoRequest(model="m"))).generation
        assert caps.guided_decoding.supported
        assert sorted(caps.guided_decoding.modes) == sorted(
            [
                pb.GUIDED_DECODING_MODE_JSON_SCHEMA,
                pb.GUIDED_DECODING_MODE_REGEX,
                pb.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
                pb.GUIDED_DECODING_MODE_CHOICE,
                pb.GUIDED_DECODING_MODE_JSON_OBJECT,
            ]
        )
    async with running_engine(sim_config()) as sim:
        caps = (await sim.stub.GetModelInfo(pb.GetModelInfoRequest(model="sim"))).generation
        assert not caps.guided_decoding.supported and not caps.guided_decoding.modes
        request = _request(pb.GuidedDecoding(regex="a"))
        request.model = "sim"
        _, error = await stream_error(sim.stub.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tokenizer" in (error.details() or "")


async def test_guides_are_built_off_the_event_loop_one_at_a_time(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large schema takes a few hundred ms to compile: not on the loop that serves every
    other call of the engine (both front ends), and one at a time (compiling holds the GIL, so
    compiles side by side would only take more of it from that loop)."""
    import threading
    import time

    from engine.core import guided
    from engine.server import engine_service

    threads: list[threading.Thread] = []
    running = [0]
    most_at_once = [0]
    lock = threading.Lock()
    compile_guide = guided.compile_guide  # what the service calls, until patched below

    def recording(spec: Any) -> Any:
        with lock:
            threads.append(threading.current_thread())
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
        try:
            time.sleep(0.05)  # long enough for the other requests' compiles to be asked for
            return compile_guide(spec)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(engine_service, "compile_guide", recording)
    async with running_engine(_config(model_dir)) as engine:
        guides = [pb.GuidedDecoding(regex=f"[0-9]{{{n}}}") for n in (2, 3, 4)]
        results = await asyncio.gather(
            *(collect(engine.stub, _request(g, max_tokens=5)) for g in guides)
        )
        for n, responses in zip((2, 3, 4), results, strict=True):
            assert re.fullmatch(f"[0-9]{{{n}}}", _result(responses)[0])
        bad = await rpc_error(
            lambda: collect(engine.stub, _request(pb.GuidedDecoding(regex="(?<=a)b")))
        )
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(threads) == 4
    assert all(t is not threading.main_thread() for t in threads)
    assert most_at_once[0] == 1
