"""Structured outputs' grammar engines side by side (bench/grammar.py): xgrammar and llguidance.

`SCHEMA`: a fixed extraction schema (an invoice of 30 top-level properties, with every bound
keyword); `instance(seed)` a valid document of it, `dumps()` its compact JSON (the form both engines
are compiled for). `ENGINES`: one adapter per library, the same calls an engine integration makes;
both fill the same bitmask format (int32 words, bit j of word i = token 32 i + j, 1 = allowed).
`PROBES`: documents just inside and just outside each bound; `INVALID_SCHEMAS`: schemas to refuse.
"""

from __future__ import annotations

import json
import random
import string
from typing import Any


def _object(properties: dict[str, dict], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """A closed object schema (`additionalProperties: false`) requiring every property but `optional`."""
    return {"type": "object", "properties": properties, "required": [k for k in properties if k not in optional],
            "additionalProperties": False}


_ADDRESS = _object({
    "street": {"type": "string", "maxLength": 64},
    "city": {"type": "string", "maxLength": 32},
    "postal_code": {"type": "string", "maxLength": 12},
    "country": {"type": "string", "enum": ["US", "DE", "FR", "GB", "JP", "CN", "CH", "NL"]},
})
_LINE_ITEM = _object({
    "description": {"type": "string", "maxLength": 80},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 10000},
    "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 100000000},
    "tax_rate_percent": {"type": "integer", "minimum": 0, "maximum": 100},
})
_CENTS = {"type": "integer", "minimum": 0, "maximum": 999999999}
_PROPERTIES: dict[str, dict] = {
    "invoice_number": {"type": "string", "maxLength": 32},
    "invoice_date": {"type": "string", "maxLength": 10},
    "due_date": {"type": "string", "maxLength": 10},
    "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CNY", "CHF"]},
    "status": {"type": "string", "enum": ["draft", "issued", "paid", "overdue", "void"]},
    "vendor_name": {"type": "string", "maxLength": 64},
    "vendor_tax_id": {"type": "string", "maxLength": 20},
    "vendor_email": {"type": "string", "maxLength": 64},
    "vendor_phone": {"type": "string", "maxLength": 20},
    "vendor_address": _ADDRESS,
    "customer_name": {"type": "string", "maxLength": 64},
    "customer_id": {"type": "string", "maxLength": 16},
    "customer_email": {"type": "string", "maxLength": 64},
    "billing_address": {"type": "string", "maxLength": 128},
    "po_number": {"type": "string", "maxLength": 24},
    "payment_terms": {"type": "string", "enum": ["net_15", "net_30", "net_60", "due_on_receipt"]},
    "payment_method": {"type": "string", "enum": ["bank_transfer", "card", "cheque", "cash"]},
    "line_items": {"type": "array", "items": _LINE_ITEM, "minItems": 1, "maxItems": 8},
    "line_item_count": {"type": "integer", "minimum": 1, "maximum": 8},
    "subtotal_cents": _CENTS,
    "tax_cents": _CENTS,
    "discount_cents": _CENTS,
    "shipping_cents": {"type": "integer", "minimum": 0, "maximum": 99999999},
    "total_cents": _CENTS,
    "amount_paid_cents": _CENTS,
    "balance_due_cents": {"type": "integer", "minimum": -999999999, "maximum": 999999999},
    "page_count": {"type": "integer", "minimum": 1, "maximum": 100},
    "is_recurring": {"type": "boolean"},
    "notes": {"type": "string", "maxLength": 200},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
}
OPTIONAL = ("billing_address", "po_number", "discount_cents", "notes")
SCHEMA: dict[str, Any] = {"title": "Invoice", **_object(_PROPERTIES, OPTIONAL)}

# one bounded string: what xgrammar's compile time grows with (the GIL check, the special tokens check)
SMALL_SCHEMA = _object({"note": {"type": "string", "maxLength": 64}})
SMALL_DOC = '{"note":"North Star Trading 東京 50% off"}'


def without(schema: Any, keyword: str) -> Any:
    """`schema` with every `keyword` removed (a copy)."""
    if isinstance(schema, dict):
        return {k: without(v, keyword) for k, v in schema.items() if k != keyword}
    if isinstance(schema, list):
        return [without(v, keyword) for v in schema]
    return schema


_WORDS = ("acme global north star river trading supply systems office paper toner cable laptop monitor desk "
          "chair service support consulting hours freight express software license annual renewal repair "
          "café münchen zürich 東京 株式会社").split()


def _text(rng: random.Random, max_len: int, extra: str = "") -> str:
    return (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 8))).title() + extra)[:max_len].rstrip()


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def instance(seed: int) -> dict[str, Any]:
    """A valid document of SCHEMA (properties in the schema's order; each optional one half the time)."""
    rng = random.Random(seed)
    items = [{"description": _text(rng, 80), "quantity": rng.randint(1, 10000),
              "unit_price_cents": rng.randint(0, 100000000), "tax_rate_percent": rng.randint(0, 100)}
             for _ in range(rng.randint(1, 8))]
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    doc: dict[str, Any] = {
        "invoice_number": f"INV-{_digits(rng, 6)}",
        "invoice_date": date,
        "due_date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "currency": rng.choice(_PROPERTIES["currency"]["enum"]),
        "status": rng.choice(_PROPERTIES["status"]["enum"]),
        "vendor_name": _text(rng, 64, " GmbH"),
        "vendor_tax_id": f"DE{_digits(rng, 9)}",
        "vendor_email": f"billing@{rng.choice(_WORDS[:12])}.example.com",
        "vendor_phone": f"+49 {_digits(rng, 3)} {_digits(rng, 7)}",
        "vendor_address": {"street": f"{_text(rng, 50)} {rng.randint(1, 999)}", "city": _text(rng, 32),
                           "postal_code": _digits(rng, 5),
                           "country": rng.choice(_ADDRESS["properties"]["country"]["enum"])},
        "customer_name": _text(rng, 64),
        "customer_id": f"C-{_digits(rng, 8)}",
        "customer_email": f"ap@{rng.choice(_WORDS[:12])}.example.org",
        "billing_address": f"{_text(rng, 60)}, {_digits(rng, 5)} {_text(rng, 30)}",
        "po_number": f"PO {_digits(rng, 10)}",
        "payment_terms": rng.choice(_PROPERTIES["payment_terms"]["enum"]),
        "payment_method": rng.choice(_PROPERTIES["payment_method"]["enum"]),
        "line_items": items,
        "line_item_count": len(items),
        "subtotal_cents": rng.randint(0, 999999999),
        "tax_cents": rng.randint(0, 99999999),
        "discount_cents": rng.randint(0, 9999),
        "shipping_cents": rng.randint(0, 99999),
        "total_cents": rng.randint(0, 999999999),
        "amount_paid_cents": rng.randint(0, 999999999),
        "balance_due_cents": rng.randint(-999999999, 999999999),
        "page_count": rng.randint(1, 100),
        "is_recurring": rng.random() < 0.5,
        "notes": _text(rng, 200, rng.choice(["", " net of fees", " (see attached)", " 50% off"])),
        "confidence": round(rng.random(), rng.randint(1, 4)),
    }
    for key in OPTIONAL:
        if rng.random() < 0.5:
            del doc[key]
    return doc


def dumps(doc: Any) -> str:
    """Compact JSON: what the compact grammars generate (UTF-8 kept, not escaped)."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def _probe_docs() -> list[tuple[str, bool, str]]:
    """(what, valid, text): one bound at a time on instance(0) (properties kept in the schema's order)."""
    base = instance(0)
    out = []

    def case(what: str, valid: bool, raw: tuple[str, str] | None = None, **changes):
        doc = dict(base)
        for key, value in changes.items():
            if value is _DROP:
                doc.pop(key, None)
            else:
                doc[key] = value
        doc = {k: doc[k] for k in sorted(doc, key=lambda k: list(_PROPERTIES).index(k) if k in _PROPERTIES else 99)}
        text = dumps(doc)
        out.append((what, valid, text.replace(*raw) if raw else text))

    item = base["line_items"][0]
    case("maxLength 32 at 32", True, invoice_number="X" * 32)
    case("maxLength 32 at 33", False, invoice_number="X" * 33)
    case("maxLength counts characters (32 x 'é')", True, invoice_number="é" * 32)
    case('escapes \\" \\n in a maxLength string', True, notes='say "hi"\nbye')
    case("raw tab in a maxLength string", False, raw=("\\t", "\t"), notes="a\tb")
    case("maxItems 8 at 8", True, line_items=[item] * 8)
    case("maxItems 8 at 9", False, line_items=[item] * 9)
    case("minItems 1 at 0", False, line_items=[])
    case("maximum 100 at 100", True, page_count=100)
    case("maximum 100 at 101", False, page_count=101)
    case("minimum 1 at 0", False, page_count=0)
    case("minimum -999999999 at -999999999", True, balance_due_cents=-999999999)
    case("minimum -999999999 at -1000000000", False, balance_due_cents=-1000000000)
    case("number maximum 1 at 1.5", False, confidence=1.5)
    case("enum member", True, currency="CHF")
    case("enum non-member", False, currency="AUD")
    case("nested enum non-member", False, vendor_address={**base["vendor_address"], "country": "XX"})
    case("required missing", False, total_cents=_DROP)
    case("optional missing", True, notes=_DROP)
    case("additionalProperties false", False, extra_field="x")
    case("integer given a fraction", False, page_count=1.5)
    out.append(("free whitespace (compact grammar)", False, json.dumps(base, ensure_ascii=False)))
    return out


_DROP = object()
PROBES = _probe_docs()

INVALID_SCHEMAS: dict[str, Any] = {
    "unknown type": {"type": "object", "properties": {"a": {"type": "strng"}}},
    "minimum > maximum": {"type": "integer", "minimum": 5, "maximum": 1},
    "dangling $ref": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    "bad regex pattern": {"type": "string", "pattern": "(unclosed"},
    "not a schema (array)": [1, 2, 3],
}


class XGrammar:
    """xgrammar: TokenizerInfo -> GrammarCompiler (cache off for cold compiles) -> CompiledGrammar
    shared by every sequence's GrammarMatcher; BatchGrammarMatcher fills many rows on a thread pool."""

    name = "xgrammar"

    def __init__(self, tokenizer, model_vocab: int, threads: int, blank_specials: bool = True):
        from importlib.metadata import version

        import xgrammar as xgr

        self.xgr = xgr
        self.version = getattr(xgr, "__version__", None) or version("xgrammar")
        self.eos = tokenizer.eos_token_id
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_vocab, stop_token_ids=[self.eos])
        if blank_specials:  # as shipped, an added special token is its literal text ("<|image_pad|>" in a string)
            vocab = [""] * model_vocab  # "" = a special token: never allowed (as the padding ids)
            for token, i in tokenizer.get_vocab().items():
                if i < model_vocab:
                    vocab[i] = token
            for i, added in tokenizer.added_tokens_decoder.items():
                if added.special and i != self.eos and i < model_vocab:
                    vocab[i] = ""
            info = xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=model_vocab, stop_token_ids=[self.eos],
                                     add_prefix_space=info.add_prefix_space)
        self.info = info
        self.vocab_ids = self.info.vocab_size
        self.threads = threads
        self.model_vocab = model_vocab
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def compiler(self, cache: bool = False, threads: int | None = None):
        return self.xgr.GrammarCompiler(self.info, max_threads=threads or self.threads, cache_enabled=cache)

    def compile(self, schema: Any, compiler=None):
        compiler = compiler or self.compiler()
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.model_vocab)

    def fill(self, matchers: list, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].accept_token(tokens[0])]
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def terminated(self, matcher) -> bool:
        return matcher.is_terminated()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def reset(self, matcher) -> None:
        matcher.reset()

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance:
    """llguidance: LLTokenizer -> a grammar string from the schema (cheap) -> LLMatcher per sequence,
    whose constructor builds the parser (the compile: no shared compiled object, no cache);
    LLExecutor fills many rows on a thread pool."""

    name = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def __init__(self, tokenizer, model_vocab: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.lt = llguidance.torch
        self.version = llguidance.__version__
        self.eos = tokenizer.eos_token_id
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model_vocab, eos_token=self.eos)
        self.vocab_ids = self.tokenizer.vocab_size
        self.model_vocab = model_vocab
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def grammar(self, schema: Any) -> str:
        return self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=self.OPTIONS)

    def compile(self, schema: Any, compiler=None):
        """A first matcher (the parser built); later sequences deep-copy it. Raises on an invalid schema."""
        matcher = self.ll.LLMatcher(self.tokenizer, self.grammar(schema), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def allocate(self, rows: int):
        return self.lt.allocate_token_bitmask(rows, self.model_vocab)

    def fill(self, matchers: list, bitmask) -> None:
        if len(matchers) == 1:
            self.lt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].consume_token(tokens[0])]
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def terminated(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()

    def rollback(self, matcher, n: int) -> None:
        assert matcher.rollback(n)

    def reset(self, matcher) -> None:
        assert matcher.reset()

    def apply(self, logits, bitmask) -> None:
        """llguidance.numpy's (llguidance.torch's is a torch.compile kernel: `apply_compiled`)."""
        import llguidance.numpy

        llguidance.numpy.apply_token_bitmask_inplace(logits.numpy(), bitmask.numpy())

    def apply_compiled(self, logits, bitmask) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def install_footprint(dist: str) -> dict[str, Any]:
    """The installed distribution's bytes on disk (its own files) and what it requires."""
    from importlib.metadata import distribution

    d = distribution(dist)
    size = sum((f.size or 0) for f in d.files or ())
    requires = sorted({r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
                       for r in d.requires or () if "extra ==" not in r})
    return {"mb": size / 1e6, "requires": requires}


def apply_bitmask_torch(logits, bitmask) -> None:
    """The bitmask applied with torch ops alone (CPU or CUDA; no library): logits[i, j] = -inf where
    bit j % 32 of bitmask[i, j // 32] is 0 (little-endian words read as bytes, a byte -> 8 bools
    table); logits columns past the bitmask's are masked too."""
    import torch

    if (table := _BIT_TABLE.get(logits.device)) is None:
        bits = torch.arange(8)
        table = _BIT_TABLE[logits.device] = ((torch.arange(256).unsqueeze(-1) >> bits) & 1).bool().to(logits.device)
    allowed = table[bitmask.view(torch.uint8).int()].flatten(1)
    width = min(logits.shape[-1], allowed.shape[-1])
    logits[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    logits[:, width:] = float("-inf")


_BIT_TABLE: dict = {}


def allowed_ids(bitmask_row, vocab: int):
    """One bitmask row as a bool array over the `vocab` ids (numpy)."""
    import numpy as np

    return np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


def token_docs(tokenizer, rows: int, first_seed: int = 0) -> list[list[int]]:
    """Row r's document: dumps(instance(first_seed + r)) tokenized, then EOS."""
    return [tokenizer.encode(dumps(instance(first_seed + r)), add_special_tokens=False) + [tokenizer.eos_token_id]
            for r in range(rows)]


def walk(engine, compiled, docs: list[list[int]], steps: int) -> dict[str, float]:
    """`steps` decode steps of len(docs) sequences: fill every row's bitmask, then each matcher
    accepts its document's next token (every one must be accepted); a finished document (EOS
    accepted, the matcher terminated) starts over after a reset (untimed). Microseconds per step
    (wall; `step_cpu_us`: the process's CPU time over the walk, per step)."""
    import statistics
    import time

    matchers = [engine.matcher(compiled) for _ in docs]
    bitmask = engine.allocate(len(docs))
    pos = [0] * len(docs)
    fills, accepts = [], []
    cpu = time.process_time()
    for _ in range(steps):
        tokens = [d[p] for d, p in zip(docs, pos)]
        t0 = time.perf_counter()
        engine.fill(matchers, bitmask)
        t1 = time.perf_counter()
        accepted = engine.accept(matchers, tokens)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
        if not all(accepted):
            r = accepted.index(False)
            raise AssertionError(f"{engine.name} rejected token {pos[r]} of row {r}'s document")
        for r in range(len(docs)):
            pos[r] += 1
            if pos[r] == len(docs[r]):
                assert engine.terminated(matchers[r]), f"{engine.name}: row {r} not terminated after EOS"
                engine.reset(matchers[r])
                pos[r] = 0
    cpu = time.process_time() - cpu  # every thread's, the untimed checks and resets included
    step = [f + a for f, a in zip(fills, accepts)]
    us = 1e6
    return {"step_us": statistics.fmean(step) * us, "fill_us": statistics.fmean(fills) * us,
            "accept_us": statistics.fmean(accepts) * us, "step_p50_us": statistics.median(step) * us,
            "step_max_us": max(step) * us, "step_cpu_us": cpu / steps * us}


def check_walk(engines: list, compiled: list, tokenizer, doc: list[int]) -> dict[str, Any]:
    """One document walked by every engine in lock-step, untimed: each token allowed by each mask, the
    padding ids never allowed, only EOS after the document; the masks compared (identical steps, mean
    allowed tokens), the steps allowing a special token (or EOS before the end) counted; rollback and
    reset give the earlier masks back."""
    import numpy as np

    vocab = engines[0].model_vocab
    specials = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i != tokenizer.eos_token_id]
    matchers = [e.matcher(c) for e, c in zip(engines, compiled)]
    masks = [e.allocate(1) for e in engines]
    identical, allowed, leaks = 0, [0] * len(engines), [0] * len(engines)
    for step, token in enumerate(doc):
        rows = []
        for i, (e, m, b) in enumerate(zip(engines, matchers, masks)):
            e.fill([m], b)
            row = allowed_ids(b[0], vocab)
            assert row[token], f"{e.name}: token {step} ({token}) not in its mask"
            assert not row[len(tokenizer):].any(), f"{e.name}: a padding id allowed"
            leaks[i] += bool(row[specials].any()) or (step < len(doc) - 1 and bool(row[tokenizer.eos_token_id]))
            if step == len(doc) - 1:
                assert row.sum() == 1, f"{e.name}: {row.sum()} tokens allowed after the document, not EOS alone"
            allowed[i] += int(row.sum())
            rows.append(row)
            assert e.accept([m], [token]) == [True]
        identical += all(np.array_equal(rows[0], r) for r in rows[1:])
    for e, m in zip(engines, matchers):
        assert e.terminated(m), f"{e.name}: not terminated after EOS"

    rollback_ok = {}
    k = min(20, len(doc) - 1)
    for e, c in zip(engines, compiled):
        m, b = e.matcher(c), e.allocate(1)

        def mask(e=e, m=m, b=b):
            e.fill([m], b)
            return b.clone()

        first = mask()
        assert all(e.accept([m], [t])[0] for t in doc[:k])
        at_k = mask()
        e.rollback(m, k)
        back = mask()
        assert all(e.accept([m], [t])[0] for t in doc[:k])
        again = mask()
        e.reset(m)
        rollback_ok[e.name] = bool((back == first).all() and (again == at_k).all() and (mask() == first).all())
    return {"steps": len(doc), "identical_steps": identical,
            "mean_allowed": {e.name: allowed[i] / len(doc) for i, e in enumerate(engines)},
            "special_steps": {e.name: leaks[i] for i, e in enumerate(engines)},
            "rollback_ok": rollback_ok}


def probe(engine, compiled, tokenizer) -> list[tuple[str, bool, bool]]:
    """(what, expected, accepted) per PROBES document: accepted = every token and then EOS accepted."""
    out = []
    for what, valid, text in PROBES:
        m = engine.matcher(compiled)
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((what, valid, all(engine.accept([m], [t])[0] for t in ids)))
    return out


def refusals(engine) -> list[tuple[str, str | None]]:
    """(what, the error (its lines joined by " | "); None if compiled) per INVALID_SCHEMAS entry."""
    out = []
    for what, schema in INVALID_SCHEMAS.items():
        try:
            engine.compile(schema)
            out.append((what, None))
        except Exception as exc:  # noqa: BLE001 (reporting whatever each library raises)
            lines = " | ".join(line.strip() for line in str(exc).strip().splitlines())
            out.append((what, f"{type(exc).__name__}: {lines}"))
    return out


def main_thread_share(fn, baseline_s: float = 0.2) -> float:
    """Python progress of this thread while `fn` runs in another, as a share of its progress alone:
    ~1 when `fn` drops the GIL (and a core is free), ~0 when it holds it."""
    import threading
    import time

    def progress(work) -> float:
        done = threading.Event()

        def run():
            work()
            done.set()

        worker = threading.Thread(target=run)
        n, start = 0, time.perf_counter()
        worker.start()
        while not done.is_set():
            n += 1
        seconds = time.perf_counter() - start
        worker.join()
        return n / seconds

    alone = max(progress(lambda: time.sleep(baseline_s)) for _ in range(2))
    during = progress(fn)
    alone = max(alone, progress(lambda: time.sleep(baseline_s)))  # before and after: the best of three
    return during / alone
