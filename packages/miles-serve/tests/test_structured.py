"""Structured output (miles.serve.structured) without the engine: a driver loop samples random
tokens among those the constraint's bitmask allows, until the constraint is finished."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import numpy as np
import pytest

from miles.core.contracts.types import TokenConstraint
from miles.serve.structured import GrammarConstraint, compile_constraint, lltokenizer_for
from miles.torch.testing import make_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "address"],
    "additionalProperties": False,
}
# A keyword llguidance does not implement, with OpenAI's strict on.
STRICT_IF_THEN = {"name": "x", "strict": True, "schema": {"type": "object", "if": {}, "then": {}}}
# Nested lists of numbers, e.g. (1,(2,3),()): a context-free language, not a regular one.
GBNF = """
root ::= "(" items? ")"
items ::= item ("," item)*
item ::= num | root
num ::= [0-9] | [1-9] [0-9]
"""


@pytest.fixture(scope="module")
def char_tok() -> Any:
    """Miles' test tokenizer: one token per character, which llguidance reads decoded."""
    return make_tokenizer(128)


@pytest.fixture(scope="module")
def bpe_tok() -> Any:
    """A byte-level BPE tokenizer (as GPT-2, Qwen, Llama 3), with multi-character tokens that
    span JSON's punctuation; llguidance reads its token bytes directly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [json.dumps({"name": "ann", "age": 31, "role": "user", "ok": True, "x": [1.5]})] * 20
    corpus += ["admin guest user city (1,(2,3)) yes no hello@example.com é ü 日本"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast: Any = PreTrainedTokenizerFast  # untyped
    return fast(tokenizer_object=tok, eos_token="<|endoftext|>")


def allowed_ids(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.arange(vocab)
    allowed: np.ndarray = ids[(bitmask_row[ids // 32] >> (ids % 32)) & 1 == 1]
    return allowed


def sample(
    constraint: TokenConstraint | None, vocab: int, eos: int, seed: int, max_steps: int = 3000
) -> tuple[list[int], bool]:
    """Random tokens among the allowed ones (any token when `constraint` is None, until EOS);
    (tokens, whether the constraint finished). The bitmask's rows start as garbage (all ones)."""
    rng = np.random.default_rng(seed)
    bitmask = np.full((3, (vocab + 31) // 32), -1, dtype=np.int32)
    ids: list[int] = []
    for _ in range(max_steps):
        if constraint is None:
            token = int(rng.integers(vocab))
        else:
            constraint.fill_bitmask(bitmask, 1)
            allowed = allowed_ids(bitmask[1], vocab)
            assert len(allowed), f"nothing allowed after {ids}"
            token = int(rng.choice(allowed))
            constraint.accept(token)
        ids.append(token)
        if (constraint is None and token == eos) or (constraint and constraint.is_finished()):
            return ids, constraint is not None
    return ids, False


def generate(tok: Any, seeds: range, **fields: Any) -> list[str]:
    """One sample per seed from one compiled constraint (its factory: one fresh state each)."""
    factory = compile_constraint(tok, **fields)
    assert factory is not None
    texts = []
    for seed in seeds:
        ids, finished = sample(factory(), len(tok), tok.eos_token_id, seed)
        assert finished, f"not finished after {len(ids)} tokens: {tok.decode(ids)[:200]!r}"
        texts.append(tok.decode(ids, skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("tok_name", ["char_tok", "bpe_tok"])
@pytest.mark.parametrize("form", ["sglang_str", "openai_strict", "openai_lenient"])
def test_json_schema_output_validates(tok_name: str, form: str, request: Any) -> None:
    tok = request.getfixturevalue(tok_name)
    spec = {"name": "person", "schema": SCHEMA, "strict": form == "openai_strict"}
    fields: dict[str, Any] = (
        {"json_schema": json.dumps(SCHEMA)}
        if form == "sglang_str"
        else {"response_format": {"type": "json_schema", "json_schema": spec}}
    )
    for text in generate(tok, range(8), **fields):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("tok_name", ["char_tok", "bpe_tok"])
def test_json_object_output_is_an_object(tok_name: str, request: Any) -> None:
    tok = request.getfixturevalue(tok_name)
    texts = generate(tok, range(12), response_format={"type": "json_object"})
    assert all(isinstance(json.loads(text), dict) for text in texts)
    assert any(len(json.loads(text)) > 0 for text in texts)  # not only "{}"


@pytest.mark.parametrize("tok_name", ["char_tok", "bpe_tok"])
@pytest.mark.parametrize(
    "regex",
    [r"(yes|no)", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?", r"a+b*"],
)
def test_regex_output_fully_matches(tok_name: str, regex: str, request: Any) -> None:
    tok = request.getfixturevalue(tok_name)
    texts = generate(tok, range(8), regex=regex)
    assert all(re.fullmatch(regex, text) for text in texts), texts
    if regex == r"(yes|no)":
        assert set(texts) == {"yes", "no"}


def _nested_list(text: str, pos: int = 0) -> int:
    """The end of the GBNF grammar's `root` that starts at `pos` (ValueError if none)."""
    if text[pos : pos + 1] != "(":
        raise ValueError(f"expected ( at {pos}")
    pos += 1
    if text[pos : pos + 1] == ")":
        return pos + 1
    while True:
        if text[pos : pos + 1] == "(":
            pos = _nested_list(text, pos)
        else:
            match = re.compile(r"[1-9][0-9]|[0-9]").match(text, pos)
            if match is None:
                raise ValueError(f"expected a number at {pos}")
            pos = match.end()
        if text[pos : pos + 1] == ")":
            return pos + 1
        if text[pos : pos + 1] != ",":
            raise ValueError(f"expected , or ) at {pos}")
        pos += 1


def in_gbnf_language(text: str) -> bool:
    try:
        return _nested_list(text) == len(text)
    except ValueError:
        return False


@pytest.mark.parametrize("tok_name", ["char_tok", "bpe_tok"])
def test_ebnf_output_is_in_the_language(tok_name: str, request: Any) -> None:
    tok = request.getfixturevalue(tok_name)
    texts = generate(tok, range(30), ebnf=GBNF)
    assert all(in_gbnf_language(text) for text in texts), texts
    assert any("((" in text or ",(" in text for text in texts)  # the grammar's recursion is used
    lark = generate(tok, range(6), ebnf='start: "x" ("-" NUM)*\nNUM: /[0-9]+/')  # Lark syntax
    assert all(re.fullmatch(r"x(-[0-9]+)*", text) for text in lark), lark


def test_without_the_mask_random_tokens_are_not_valid(char_tok: Any, bpe_tok: Any) -> None:
    """The checks above can fail: the same random sampling, unmasked, gives none of these."""
    for tok in (char_tok, bpe_tok):
        for seed in range(20):
            ids, _ = sample(None, len(tok), tok.eos_token_id, seed, max_steps=200)
            text = tok.decode(ids, skip_special_tokens=True)
            with pytest.raises(ValueError):  # JSONDecodeError is a ValueError
                json.loads(text)
            assert not re.fullmatch(r"-?[0-9]{1,4}(\.[0-9]{1,2})?", text)
            assert not in_gbnf_language(text)


def test_no_constraint(char_tok: Any) -> None:
    assert compile_constraint(char_tok) is None
    assert compile_constraint(char_tok, response_format={"type": "text"}) is None
    # "text" is the absence of a format, so it goes with another field.
    assert compile_constraint(char_tok, response_format={"type": "text"}, regex="a") is not None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": '{"type": "foo"}'}, r"^json_schema: .*foo"),
        ({"json_schema": "{not json"}, r"^json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, r"^json_schema must be a JSON schema object"),
        ({"json_schema": json.dumps({"type": "object", "if": {}, "then": {}})}, r"if"),
        ({"json_schema": '{"type": "integer", "minimum": 5, "maximum": 3}'}, r"json_schema.*5"),
        ({"regex": "(ab"}, r"(?s)^regex: .*unclosed group"),
        ({"regex": 5}, r"^regex must be a string"),
        ({"ebnf": 'root ::= "a" undefined_rule'}, r"^ebnf: .*undefined_rule"),
        ({"ebnf": 'root ::= "a'}, r"^ebnf: "),
        ({"response_format": {"type": "xml"}}, r"response_format type 'xml' is not supported"),
        ({"response_format": "json"}, r"^response_format must be an object"),
        ({"response_format": {"type": "json_schema"}}, r"response_format.json_schema must be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            r"^response_format.json_schema.schema: ",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": STRICT_IF_THEN}},
            r"^response_format.json_schema.schema: .*if",
        ),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, r"at most one .*'regex', 'ebnf'"),
        (
            {"response_format": {"type": "json_object"}, "json_schema": "{}"},
            r"at most one .*'response_format', 'json_schema'",
        ),
    ],
)
def test_bad_requests_raise_value_error_naming_the_field(
    char_tok: Any, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compile_constraint(char_tok, **fields)


def test_without_strict_unimplemented_keywords_are_ignored(char_tok: Any) -> None:
    schema = {"type": "object", "if": {}, "then": {}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert compile_constraint(char_tok, response_format=rf) is not None


def constraint_of(tok: Any, **fields: Any) -> GrammarConstraint:
    factory = compile_constraint(tok, **fields)
    assert factory is not None
    return factory()


def _tok_id(tok: Any, text: str) -> int:
    return int(tok.convert_tokens_to_ids(text))


def test_end_of_response(char_tok: Any) -> None:
    """Complete and not extendable: finished without EOS. Complete but extendable: EOS allowed,
    finished once EOS is accepted."""
    eos, a, b = char_tok.eos_token_id, _tok_id(char_tok, "a"), _tok_id(char_tok, "b")
    bitmask = np.zeros((1, 4), dtype=np.int32)
    closed = constraint_of(char_tok, regex="ab")
    closed.accept(a)
    closed.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask[0], 128).tolist() == [b] and not closed.is_finished()
    closed.accept(b)
    closed.fill_bitmask(bitmask, 0)
    assert closed.is_finished() and allowed_ids(bitmask[0], 128).tolist() == [eos]

    open_ = constraint_of(char_tok, regex="a+")
    open_.accept(a)
    open_.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask[0], 128).tolist() == sorted([a, eos, _tok_id(char_tok, "aa")])
    assert open_.is_accepting() and not open_.is_finished()
    open_.accept(eos)
    assert open_.is_finished() and open_.error is None


def test_eos_tokens_can_be_given(char_tok: Any) -> None:
    eos = char_tok.eos_token_id  # <|im_end|>
    im_start = char_tok.convert_tokens_to_ids("<|im_start|>")
    constraint = constraint_of(char_tok, regex="a*", eos_token_ids=[eos, 0])
    bitmask = np.zeros((1, 4), dtype=np.int32)
    constraint.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask[0], 128).tolist()
    assert eos in allowed and 0 in allowed and im_start not in allowed


def test_a_forbidden_token_finishes_with_an_error(char_tok: Any) -> None:
    constraint = constraint_of(char_tok, regex="ab")
    constraint.accept(_tok_id(char_tok, "z"))
    assert constraint.is_finished() and constraint.error
    beyond = constraint_of(char_tok, regex="ab")
    beyond.accept(500)
    assert beyond.is_finished() and "outside" in (beyond.error or "")


def test_model_vocab_larger_or_smaller_than_the_tokenizer(char_tok: Any) -> None:
    factory = compile_constraint(char_tok, regex="[a-z ]+")
    assert factory is not None
    exact = np.zeros((1, 4), dtype=np.int32)
    factory().fill_bitmask(exact, 0)
    wide = np.full((2, 7), -1, dtype=np.int32)  # a model vocab of 224 (> 128 tokens)
    factory().fill_bitmask(wide, 1)
    assert (wide[1, :4] == exact[0]).all() and (wide[1, 4:] == 0).all() and (wide[0] == -1).all()
    narrow = np.full((1, 3), -1, dtype=np.int32)  # 96 (< 128): the first 96 tokens' bits
    factory().fill_bitmask(narrow, 0)
    assert (narrow[0] == exact[0, :3]).all()
    with pytest.raises(TypeError):
        factory().fill_bitmask(np.zeros((1, 4), dtype=np.int64), 0)


def test_samples_of_one_request_are_independent(char_tok: Any) -> None:
    factory = compile_constraint(char_tok, regex="ab")
    assert factory is not None
    first, second = factory(), factory()
    first.accept(_tok_id(char_tok, "a"))
    first.accept(_tok_id(char_tok, "b"))
    assert first.is_finished() and not second.is_finished()
    second.accept(_tok_id(char_tok, "a"))
    assert not second.is_finished()


def test_the_llguidance_tokenizer_is_cached(char_tok: Any, bpe_tok: Any) -> None:
    assert lltokenizer_for(char_tok) is lltokenizer_for(char_tok)
    assert lltokenizer_for(char_tok, [2, 0]) is not lltokenizer_for(char_tok)
    assert lltokenizer_for(bpe_tok).vocab_size == len(bpe_tok)


def test_a_tokenizer_whose_tokens_lose_text_is_refused() -> None:
    """A word-level tokenizer splitting on whitespace: its tokens hold no spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "a": 2, "b": 3}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast: Any = PreTrainedTokenizerFast  # untyped
    tok = fast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    with pytest.raises(ValueError, match="does not support this tokenizer"):
        compile_constraint(tok, regex="a")
