"""Tokenizers, as a dataset's meta.json records them ({"kind": ...}) so that train, sample, eval
and export all use the dataset's own: "char" (shakespeare_char's characters), "tiktoken"
(GPT-2's BPE) and "hf", any Hugging Face `tokenizers` tokenizer, its tokenizer.json kept whole
in the record (a run directory's dataset.json then holds it, whatever happens to the file).

Text is text: a special token written in it ("<|endoftext|>" inside a document) is encoded as
the ordinary characters it is made of, by every kind (tiktoken's encode_ordinary, tokenizers'
encode_special_tokens) and by the export's (hf_tokenizer: split_special_tokens). Only data.py puts
an end-of-text id between documents, so a document cannot end another one by what it says; a
tokenizer's own additions around a text (a post-processor's [CLS] ... [SEP] or <s>) are dropped
everywhere (plain), so that data.py, sample.py, eval.py and the export encode alike."""
from pathlib import Path
from typing import Callable

from run.errors import UsageError

# end-of-text tokens that separate documents, looked for in this order in a HF tokenizer
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


def encoding(name: str):
    import tiktoken
    try:
        return tiktoken.get_encoding(name)
    # Its files are fetched once into its cache (TIKTOKEN_CACHE_DIR): offline, a ConnectionError.
    except Exception as e:
        why = f"cannot load tiktoken's {name} encoding ({type(e).__name__})"
        raise UsageError(f"{why}: get internet, or set TIKTOKEN_CACHE_DIR to a folder of its "
                         "cached files") from None


def plain(tok):
    """A `tokenizers` Tokenizer without its post-processor: the ids of the text alone."""
    tok.post_processor = None
    return tok


def for_documents(name: str) -> tuple[dict, int, Callable[[str], list[int]]]:
    """data.py's tokenizer: its record, its vocabulary size, and a function from a document to
    its ids followed by the end-of-text id. name: gpt2, a tokenizer.json, or a Hub id."""
    if name == "gpt2":
        enc = encoding(name)
        record = {"kind": "tiktoken", "encoding": name, "eos": enc.eot_token}
        return record, size(record), lambda text: enc.encode_ordinary(text) + [enc.eot_token]
    from tokenizers import Tokenizer

    try:
        tok = plain(Tokenizer.from_file(name) if Path(name).is_file()
                    else Tokenizer.from_pretrained(name))
    except Exception as e:  # not a tokenizer.json, or no such Hub id, or offline
        raise UsageError(f"--tokenizer={name}: neither gpt2, a tokenizer.json nor a Hugging Face "
                         f"id that loads ({type(e).__name__}: {str(e)[:100]})") from None
    vocab = tok.get_vocab()
    eos = next((t for t in EOS_NAMES if t in vocab), None)
    if eos is None:
        raise UsageError(f"--tokenizer={name} has none of the end-of-text tokens {EOS_NAMES}: "
                         "add one, to separate the documents")
    record = {"kind": "hf", "name": name, "eos": vocab[eos], "json": tok.to_str()}

    def encode(text: str) -> list[int]:
        # text is text (the docstring); set at each call: a pickled Tokenizer (datasets' worker
        # processes get one) forgets it
        tok.encode_special_tokens = True
        return tok.encode(text).ids + [vocab[eos]]

    return record, size(record), encode


def load(record: dict) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) between text and ids, as meta.json's record says."""
    if record["kind"] == "char":
        index = {c: i for i, c in enumerate(record["chars"])}

        def encode(text: str) -> list[int]:
            if unknown := "".join(sorted(set(text) - index.keys())):
                raise UsageError(f"characters {unknown!r} are not in the dataset's vocabulary")
            return [index[c] for c in text]

        return encode, lambda ids: "".join(record["chars"][i] for i in ids)
    if record["kind"] == "hf":
        from tokenizers import Tokenizer

        tok = plain(Tokenizer.from_str(record["json"]))  # a record made before plain too
        tok.encode_special_tokens = True  # text is text (the docstring)
        encode = lambda text: tok.encode(text).ids
        return encode, lambda ids: tok.decode(list(ids), skip_special_tokens=False)
    enc = encoding(record["encoding"])
    return (lambda text: enc.encode_ordinary(text)), (lambda ids: enc.decode(list(ids)))


def size(record: dict) -> int:
    """How many ids the tokenizer can give (a dataset's vocab_size): one more than its largest."""
    if record["kind"] == "char":
        return len(record["chars"])
    if record["kind"] == "hf":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(record["json"])
        # the ids reach the largest in the vocabulary, which get_vocab_size (a count) may not
        return max(tok.get_vocab_size(), max(tok.get_vocab().values()) + 1)
    return encoding(record["encoding"]).n_vocab


def special_ids(record: dict) -> tuple[int, ...]:
    """The ids a model.py edit may treat apart (no loss on the end-of-text between documents):
    the fast paths' check draws them among its targets. A character vocabulary has none."""
    return (record["eos"],) if record.get("eos") is not None else ()


def hf_tokenizer(meta: dict):
    """The dataset's tokenizer (meta.json's record) as a transformers fast tokenizer. Special
    tokens written in a text are split as ordinary text (split_special_tokens), as load's
    encoders read them for training, sample.py and eval.py: one tokenization."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = meta["tokenizer"]
    if tok["kind"] == "char":  # one id per character, no merges; decoded by joining
        from hf.tokenization_mugpt import MuGPTCharTokenizer

        vocab = {c: i for i, c in enumerate(tok["chars"])}
        # an unknown token it has no id for: a character outside the vocabulary is refused when
        # encoded (without one, the BPE model drops it silently)
        unk = f"(the text holds a character outside this model's {len(vocab)} characters)"
        core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
        core.decoder = decoders.Fuse()
        # No end-of-text character: lm-eval needs a prefix for an empty context (bos) and pads
        # batches (never read: any id does); the first character (a newline) serves for both, in
        # a class whose decode skips no id: transformers' skips its special tokens, here text
        first = tok["chars"][0]
        return MuGPTCharTokenizer(tokenizer_object=core, bos_token=first, pad_token=first,
                                  split_special_tokens=True)
    if tok["kind"] == "hf":
        core = plain(Tokenizer.from_str(tok["json"]))  # as training encoded
        eos = core.id_to_token(tok["eos"])
        return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=eos,
                                       split_special_tokens=True)
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = encoding(tok["encoding"])
    converter = TikTokenConverter(pattern=enc._pat_str)
    converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks  # tiktoken's own ranks
    core = converter.converted()
    eos = enc.decode([enc.eot_token])
    core.add_special_tokens([eos])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, bos_token=eos,
                                   pad_token=eos, split_special_tokens=True)
