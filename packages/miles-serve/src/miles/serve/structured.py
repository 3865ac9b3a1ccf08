"""Structured output for `miles serve`: the request's JSON schema, regex or grammar as a
`TokenConstraint` (miles.core.contracts.types), built on llguidance (https://github.com/guidance-ai/llguidance).

One request names at most one of:
  - OpenAI `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
    object), {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
  - SGLang's sampling params `json_schema` (a schema, as a JSON string), `regex` (Rust `regex`
    syntax, matched against the whole response), `ebnf` (a GBNF grammar, as llama.cpp and
    xgrammar write them, `root ::= ...`; a Lark grammar, `start: ...`, is taken as it is).

`compile_constraint` checks and compiles the grammar once per request (a `ValueError` naming the
field when it is wrong: the server's 400) and returns a factory: each call gives a fresh, stateful
constraint, one per sample when n > 1.

Schemas: with `strict: true` (OpenAI) and for SGLang's `json_schema`, a keyword llguidance does
not implement (`if`/`then`, ...) is an error; without strict (OpenAI's default) it is ignored.
JSON output may hold whitespace between tokens, as llguidance's default allows.

End of the response: the constraint is finished once llguidance's matcher is stopped, which is
either (a) the grammar is complete and cannot be extended (a closed JSON object, `regex="ab"`
after "ab"): only EOS could follow, so the engine stops there without sampling that forced EOS
(the response holds no EOS token), or (b) the grammar is complete but could go on (`regex="a+"`):
the mask allows EOS besides the grammar's tokens, and once the engine reports a sampled EOS the
constraint is finished (the EOS is then the response's last token, as without a constraint).
A token the grammar forbids (an engine that did not apply the mask) puts the matcher in an error
state, which also finishes it; `GrammarConstraint.error` says why.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt

from miles.core.contracts.types import TokenConstraint

logger = logging.getLogger(__name__)

ConstraintFactory = Callable[[], TokenConstraint]

_FIELDS = ("response_format", "json_schema", "regex", "ebnf")
_MAX_ERROR_CHARS = 2000
# Text that a tokenizer's tokens, decoded one by one, must reproduce (see _from_decoded_tokens).
_PROBE = '{"name": "Ada", "ids": [1, -2.5e3, true, null], "s": "a\\"b"}\n x_y: z;'


class GrammarConstraint:
    """One sample's structured-output state (a `TokenConstraint`) over an llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._error: str | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher (for batched mask filling, `llguidance.numpy.fill_next_token_
        bitmask_par`, which needs the row to be exactly `ceil(vocab_size / 32)` words)."""
        return self._matcher

    @property
    def error(self) -> str | None:
        """Why the constraint stopped early (a token the grammar forbids), else None."""
        if self._error is None and self._matcher.is_error():
            self._error = _short(self._matcher.get_error())
        return self._error

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`. Tokens past the tokenizer's
        vocabulary (a model vocab padded beyond it) are disallowed."""
        if bitmask.dtype != np.int32:
            raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
        out = bitmask[row]
        n = self._words
        if len(out) >= n and out.flags.c_contiguous:
            target = out[:n]
            self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, n * 4)
            out[n:] = 0
            return
        scratch = np.empty(n, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, n * 4)
        k = min(n, len(out))
        out[:k] = scratch[:k]
        out[k:] = 0

    def accept(self, token_id: int) -> None:
        """Advance the grammar by the sampled token."""
        if self._error is not None:
            return
        if not 0 <= token_id < self._vocab_size:
            self._error = f"token {token_id} is outside the tokenizer's {self._vocab_size} tokens"
        elif not self._matcher.consume_token(token_id):
            self._error = _short(self._matcher.get_error()) or f"token {token_id} was rejected"
        else:
            return
        logger.warning("structured output: the grammar rejected a token: %s", self._error)

    def is_finished(self) -> bool:
        """The response must stop here (see the module's docstring)."""
        return self._error is not None or self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The response so far is complete (EOS may come next)."""
        return self._matcher.is_accepting()


class CompiledGrammar:
    """A request's checked grammar: calling it gives a fresh constraint (one per sample)."""

    def __init__(self, field: str, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.field = field  # the request field it came from
        self._prototype = matcher
        self._vocab_size = vocab_size

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self._prototype.deep_copy(), self._vocab_size)


def compile_constraint(
    tokenizer: Any,
    *,
    response_format: Mapping[str, Any] | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> CompiledGrammar | None:
    """The structured-output constraint a request asks for, or None when it asks for none.

    `tokenizer` is the model's Hugging Face tokenizer; `eos_token_ids` the tokens that end a
    response (default: the tokenizer's eos token), which the mask allows where the grammar is
    complete. At most one of the other arguments may be given (None: absent); a mistake in it
    raises a `ValueError` that names the field.
    """
    parsed = _grammar_of(
        response_format=response_format, json_schema=json_schema, regex=regex, ebnf=ebnf
    )
    if parsed is None:
        return None
    field, grammar = parsed
    ll_tokenizer = lltokenizer_for(tokenizer, eos_token_ids)
    try:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{field}: {_short(str(err))}") from err
    if matcher.is_error():
        raise ValueError(f"{field}: {_short(matcher.get_error())}")
    for warning in matcher.get_grammar_warnings():
        logger.info("structured output: %s: %s", field, warning)
    return CompiledGrammar(field, matcher, ll_tokenizer.vocab_size)


# -- request fields -> llguidance grammar ------------------------------------------------------


def _grammar_of(**fields: Any) -> tuple[str, str] | None:
    """(field name, llguidance grammar) of the one structured-output field given, or None."""
    rf = fields["response_format"]
    if rf is not None and not isinstance(rf, Mapping):
        raise ValueError(f"response_format must be an object, got {type(rf).__name__}")
    if rf is not None and rf.get("type") == "text":
        fields["response_format"] = None
    given = [name for name in _FIELDS if fields[name] is not None]
    if len(given) > 1:
        raise ValueError(f"at most one structured-output field per request; got {given}")
    if not given:
        return None
    name = given[0]
    value = fields[name]
    if name == "response_format":
        return _response_format_grammar(value)
    if name == "json_schema":
        return name, _json_grammar(name, value, lenient=False)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if name == "regex":
        return name, llguidance.LLMatcher.grammar_from_regex(value)
    try:
        return name, llguidance.grammar_from("ebnf", value)
    except ValueError as err:
        raise ValueError(f"ebnf: {_short(str(err))}") from err


def _response_format_grammar(rf: Mapping[str, Any]) -> tuple[str, str]:
    kind = rf.get("type")
    if kind == "json_object":
        return "response_format", _json_grammar("response_format", {"type": "object"}, False)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping) or spec.get("schema") is None:
            raise ValueError(
                "response_format.json_schema must be an object with a 'schema' "
                '({"name": ..., "schema": {...}, "strict": ...})'
            )
        field = "response_format.json_schema.schema"
        return field, _json_grammar(field, spec["schema"], lenient=spec.get("strict") is not True)
    raise ValueError(
        f"response_format type {kind!r} is not supported; "
        "expected 'text', 'json_object' or 'json_schema'"
    )


def _json_grammar(field: str, schema: Any, lenient: bool) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field} is not valid JSON: {err}") from err
    if isinstance(schema, Mapping):
        schema = dict(schema)
    elif not isinstance(schema, bool):
        raise ValueError(f"{field} must be a JSON schema object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"lenient": True} if lenient else None
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"{field}: {_short(str(err))}") from err


def _short(message: str) -> str:
    """llguidance's message without its trailing parser state dump, and not too long."""
    message = message.split("\n<state>", 1)[0].strip()
    if len(message) > _MAX_ERROR_CHARS:
        message = message[:_MAX_ERROR_CHARS] + "..."
    return message


# -- Hugging Face tokenizer -> llguidance tokenizer (cached) -----------------------------------

_cache: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_cache_lock = threading.Lock()


def lltokenizer_for(
    tokenizer: Any, eos_token_ids: Sequence[int] | None = None
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer, built once per tokenizer object and eos
    set (building it takes about a second for a 150k vocabulary); safe from any thread."""
    key = tuple(int(t) for t in eos_token_ids or ())
    with _cache_lock:
        try:
            per_tokenizer = _cache.setdefault(tokenizer, {})
        except TypeError:  # neither hashable nor weakly referable: build every time
            per_tokenizer = {}
        if key not in per_tokenizer:
            per_tokenizer[key] = _build_lltokenizer(tokenizer, list(key) or None)
        return per_tokenizer[key]


def _build_lltokenizer(tokenizer: Any, eos: list[int] | None) -> llguidance.LLTokenizer:
    import llguidance.hf

    if eos is None and getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("structured output needs an end-of-sequence token: the tokenizer has none")
    try:
        # Exact token bytes for byte-level BPE and byte-fallback (SentencePiece) tokenizers.
        return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    except ValueError as err:
        return _from_decoded_tokens(tokenizer, eos, reason=str(err))


def _from_decoded_tokens(
    tokenizer: Any, eos: list[int] | None, reason: str
) -> llguidance.LLTokenizer:
    """For tokenizers llguidance cannot read (e.g. word- or character-level ones): each token's
    bytes are its text decoded alone, which must reproduce a probe text token by token."""
    n = len(tokenizer)
    tokens = [text.encode() for text in tokenizer.batch_decode([[i] for i in range(n)])]
    probe_ids = tokenizer.encode(_PROBE, add_special_tokens=False)
    if b"".join(tokens[i] for i in probe_ids) != _PROBE.encode():
        raise ValueError(
            f"structured output does not support this tokenizer: llguidance cannot read it "
            f"({_short(reason)}), and its tokens decoded one by one do not reproduce text"
        )
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    wrapper = _TokenList(tokenizer, tokens, sorted(i for i in special if i < n))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), eos_token=eos)


class _TokenList:
    """What `llguidance.TokenizerWrapper` reads: token bytes, special ids, and an encoder."""

    def __init__(self, tokenizer: Any, tokens: list[bytes], special: list[int]) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokens
        self.special_token_ids = special
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        ids: list[int] = self._tokenizer.encode(
            text.decode("utf-8", errors="replace"), add_special_tokens=False
        )
        return ids
