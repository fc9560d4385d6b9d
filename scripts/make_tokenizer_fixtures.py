#!/usr/bin/env python3
"""Writes the reference fixtures of tests/test_tokenizer.cpp.

Every expected token id comes from Hugging Face `tokenizers` (the Rust
library behind transformers' fast tokenizers), never from kvforge:

* pyllama_heldout.json: the shared model's tokenizer.json on the shared
  heldout.txt, as a whole and cut into ~64 chunks at line boundaries (count
  and SHA-256 of the int32 little-endian ids of each).
* <style>.tokenizer.json: small BPE tokenizers trained here on a slice of
  calib.txt, one per family of real tokenizer.json files (Llama 3, Qwen 2,
  Llama 2 / Mistral SentencePiece style, GPT-2).
* <style>.cases.json: for each style and for variants of it (top-level
  tokenizer.json fields replaced by a "patch"), the encodings of a set of
  test strings with and without special tokens and their decodings.

Usage: python3 scripts/make_tokenizer_fixtures.py [--shared ../shared]
Needs: tokenizers==0.23.2 (pip). Deterministic: re-running gives the same files.
"""
import argparse
import hashlib
import json
import struct
from pathlib import Path

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "tokenizers"

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHUNKS = 64
TRAIN_BYTES = 400_000
# Short texts that exercise what code slices do not: unicode, normal forms,
# whitespace, digits, contractions, characters that look like vocabulary
# internals. Added/special tokens are mixed in per style (see cases_for).
CUSTOM_TEXTS = [
    "",
    " ",
    "\n",
    "Hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\r\nmixed \n\n  \t",
    "a" + " " * 20 + "b" + "\n" * 5 + "c\t \t",
    "digits 0123456789 12345678901234 3.14159 1e-10 \u0661\u0662\u0663 \u00b2\u00b3 \u2167",
    "accents: caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m",
    "decomposed: cafe\u0301 n\u0303o A\u030angstrom \u1e9b\u0323",
    "CJK: \u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4",
    "emoji: \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7!",
    "contractions: I'm you're it's WE'LL they'D don't 'S 'Re",
    "long s: '\u017f \u017fo K\u212a",
    "unicode spaces:\u0085NEL\u00a0nbsp\u2028ls\u3000ideo\u2009thin",
    "\u2581 metaspace \u2581\u2581x \u2581",
    "\u0120 \u010a byte-level look-alikes \u0100\u0143",
    "<0x41> <0xZZ> literal byte-token text",
    "\u2126mega and \u03a9mega",
    "def f(x):\n    return x**2 != {'a': [1, 2]}  # comment\n\n\n",
    "\t\tif  (a<b)&&(c>=d) { x -= 0x1F; }   // done",
]
# Left out of the training text, so that these characters are missing from
# the vocabularies (byte fallback, unk).
UNSEEN_TEXTS = [
    "runes \u16a0\u16c7\u16bb \u222e \u2153 \U0001d518\U0001d52b\U0001d526 \u0f40\u0f72",
    "ignore_merges: zzyzx Zzyzx zzyzxzzyzx",
]


def ids_sha256(ids):
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def line_chunks(data: bytes, count: int):
    """[begin, end) byte ranges: `count` pieces of similar size, cut after a newline."""
    ranges, begin = [], 0
    for k in range(1, count):
        target = len(data) * k // count
        if target <= begin:
            continue
        cut = data.find(b"\n", target)
        if cut < 0:
            break
        ranges.append((begin, cut + 1))
        begin = cut + 1
    ranges.append((begin, len(data)))
    return ranges


def pyllama_fixture(shared: Path):
    tok_path = shared / "models" / "pyllama-16m" / "tokenizer.json"
    text_path = shared / "data" / "heldout.txt"
    tok = Tokenizer.from_file(str(tok_path))
    data = text_path.read_bytes()
    ids = tok.encode(data.decode("utf-8"), add_special_tokens=False).ids
    chunks = []
    for begin, end in line_chunks(data, CHUNKS):
        chunk_ids = tok.encode(data[begin:end].decode("utf-8"), add_special_tokens=False).ids
        chunks.append({"begin": begin, "end": end, "count": len(chunk_ids), "ids_sha256": ids_sha256(chunk_ids)})
    return {
        "tokenizer": "models/pyllama-16m/tokenizer.json",
        "tokenizer_sha256": hashlib.sha256(tok_path.read_bytes()).hexdigest(),
        "text": "data/heldout.txt",
        "text_sha256": hashlib.sha256(data).hexdigest(),
        "count": len(ids),
        "ids_sha256": ids_sha256(ids),
        "prefix_ids": ids[:256],
        "chunks": chunks,
    }


def training_text(shared: Path):
    calib = (shared / "data" / "calib.txt").read_bytes()[:TRAIN_BYTES]
    calib = calib[:calib.rfind(b"\n") + 1].decode("utf-8")
    # A little non-code text so that accents, CJK and emoji get merges too.
    extra = "\n".join(t for t in CUSTOM_TEXTS if t) * 20
    return [line for line in (calib + extra).splitlines(keepends=True)]


def byte_level_trainer(vocab_size, specials):
    return trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def train_llama3(lines):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.train_from_iterator(lines, byte_level_trainer(1500, specials))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    tok.decoder = decoders.ByteLevel()
    # A whole word that merges cannot reach: with ignore_merges it is one token.
    doc = json.loads(tok.to_str())
    assert "\u0120zzyzx" not in doc["model"]["vocab"]
    doc["model"]["vocab"]["\u0120zzyzx"] = max(doc["model"]["vocab"].values()) + 1
    return Tokenizer.from_str(json.dumps(doc))


def train_qwen2(lines):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.train_from_iterator(lines, byte_level_trainer(1500, specials))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # Non-special added tokens: one matched in the raw text, one (Omega)
    # matched after NFC, which maps U+2126 OHM SIGN to U+03A9.
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("\u03a9mega", special=False, normalized=True)])
    return tok


def train_llama2(lines):
    """SentencePiece-converted layout: <unk> <s> </s>, then <0x00>..<0xFF>, then merges."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    # Only for training: words start at each U+2581, as in SentencePiece.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=1800, special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                  show_progress=False, limit_alphabet=150)
    tok.train_from_iterator(lines, trainer)
    doc = json.loads(tok.to_str())
    # Byte tokens live in the vocab only (else "<0x41>" typed in text would
    # match as an added token); merges in the legacy "a b" string form.
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in byte_tokens]
    doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    doc["pre_tokenizer"] = None
    doc["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]).__getstate__())
    doc["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
    ]).__getstate__())
    return Tokenizer.from_str(json.dumps(doc))


def train_gpt2(lines):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.train_from_iterator(lines, byte_level_trainer(1200, ["<|endoftext|>"]))
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.decoder = decoders.ByteLevel()
    # The less common added-token flags: lstrip, rstrip, single_word.
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, special=True, normalized=False)])
    tok.add_tokens([AddedToken("[SEP]", rstrip=True, special=False, normalized=False),
                    AddedToken("hello", single_word=True, special=False, normalized=True)])
    return tok


def state(component):
    return json.loads(component.__getstate__())


def variants(style):
    """(name, patch) pairs. A patch replaces top-level tokenizer.json fields;
    its "model" entry, if any, is merged into the model object instead."""
    out = [("base", {})]
    if style == "llama2":
        # Newer Mistral/Llama exports: Metaspace pre-tokenizer instead of the normalizer.
        out.append(("metaspace_first", {
            "normalizer": None,
            "pre_tokenizer": state(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)),
            "decoder": state(decoders.Sequence([decoders.ByteFallback(),
                                                decoders.Metaspace(replacement="\u2581", prepend_scheme="first")])),
        }))
        out.append(("metaspace_always_split", {
            "normalizer": None,
            "pre_tokenizer": state(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)),
            "decoder": state(decoders.Sequence([decoders.ByteFallback(),
                                                decoders.Metaspace(replacement="\u2581", prepend_scheme="always")])),
        }))
        out.append(("unk_fused", {"model": {"byte_fallback": False}}))
        out.append(("unk_not_fused", {"model": {"byte_fallback": False, "fuse_unk": False}}))
        out.append(("metaspace_never_digits", {
            "normalizer": state(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])),
            "pre_tokenizer": state(pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)])),
            "decoder": state(decoders.Metaspace(replacement="\u2581", prepend_scheme="never")),
        }))
    if style == "gpt2":
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        for behavior in ["removed", "merged_with_previous", "merged_with_next", "contiguous"]:
            out.append((f"split_{behavior}", {"pre_tokenizer": state(pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(r"\s+|[,.;:()]"), behavior=behavior, invert=False), no_regex]))}))
        out.append(("split_string_inverted", {"pre_tokenizer": state(pre_tokenizers.Sequence([
            pre_tokenizers.Split(" ", behavior="isolated", invert=True), no_regex]))}))
        out.append(("digits_grouped_nfd_strip", {
            "normalizer": state(normalizers.Sequence([normalizers.NFD(), normalizers.Strip(left=True, right=True),
                                                      normalizers.Replace(Regex(r"\d{2}"), "##")])),
            "pre_tokenizer": state(pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])),
        }))
        out.append(("no_decoder_word_regex", {
            "pre_tokenizer": state(pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(r"\w+|\s+|\h+"), behavior="isolated", invert=False), no_regex])),
            "decoder": None,
        }))
    return out


def apply_patch(doc, patch):
    out = dict(doc)
    for key, value in patch.items():
        out[key] = dict(doc[key], **value) if key == "model" else value
    return out


def heldout_slices(shared: Path, count=3, size=2500):
    data = (shared / "data" / "heldout.txt").read_bytes()
    out = []
    for k in range(count):
        begin = data.find(b"\n", len(data) * (2 * k + 1) // (2 * count + 1)) + 1
        end = data.find(b"\n", begin + size) + 1
        out.append((begin, end, data[begin:end].decode("utf-8")))
    return out


def decoded_entry(text):
    """Short decodings verbatim, long ones by SHA-256 of their UTF-8."""
    if len(text.encode("utf-8")) <= 400:
        return {"text": text}
    return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def cases_for(tok: Tokenizer, style: str, slices):
    added = [t.content for t in sorted(tok.get_added_tokens_decoder().values(), key=lambda t: t.content)]
    texts = CUSTOM_TEXTS + UNSEEN_TEXTS
    # Added and special tokens inside text, at the start, doubled, at the end.
    texts.append(added[0] + "Hello" + added[-1] + " world " + "".join(added) + " end" + added[0])
    texts.append("x " + " ".join(added) + "  " + added[-1] + "\n" + added[0] + added[0])
    if style == "gpt2":
        texts += ["a <mask> b  <mask>c", "x[SEP]   y [SEP]\nz", "hello hello, ahello hello_ hello"]
    inputs = [({"text": text}, text) for text in texts]
    inputs += [({"heldout": [begin, end]}, text) for begin, end, text in slices]
    cases = []
    for case, text in inputs:
        special = tok.encode(text, add_special_tokens=True).ids
        case["ids"] = tok.encode(text, add_special_tokens=False).ids
        case["ids_with_special"] = special
        case["decoded"] = decoded_entry(tok.decode(special, skip_special_tokens=False))
        case["decoded_skip_special"] = decoded_entry(tok.decode(special, skip_special_tokens=True))
        cases.append(case)
    return cases


def write_json(path: Path, value, compact=False):
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None,
                      indent=None if compact else 1)
    path.write_text(text + "\n", encoding="utf-8")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    write_json(OUT / "pyllama_heldout.json", pyllama_fixture(args.shared))

    lines = training_text(args.shared)
    slices = heldout_slices(args.shared)
    for style, train in [("llama3", train_llama3), ("qwen2", train_qwen2), ("llama2", train_llama2),
                         ("gpt2", train_gpt2)]:
        base = train(lines)
        base_doc = json.loads(base.to_str())
        write_json(OUT / f"{style}.tokenizer.json", base_doc, compact=True)
        suite = {"tokenizers_version": tokenizers.__version__, "tokenizer": f"{style}.tokenizer.json", "variants": []}
        for name, patch in variants(style):
            doc = apply_patch(base_doc, patch)
            tok = Tokenizer.from_str(json.dumps(doc))
            # Code slices only for the base configuration: variants differ on the short texts.
            cases = cases_for(tok, style, slices if name == "base" else [])
            suite["variants"].append({"name": name, "patch": patch, "cases": cases})
        write_json(OUT / f"{style}.cases.json", suite, compact=True)
    print(f"wrote fixtures to {OUT}")


if __name__ == "__main__":
    main()
