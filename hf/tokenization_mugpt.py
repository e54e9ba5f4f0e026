"""The tokenizer of an export whose dataset has a character vocabulary (meta.json's "char"), copied
next to the weights by its save_pretrained (the auto_map of tokenizer_config.json), so that
`AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)` loads it, as the model is loaded."""
from transformers import PreTrainedTokenizerFast


class MuGPTCharTokenizer(PreTrainedTokenizerFast):
    """One id per character, decoded by joining. A character serves as its bos and pad token
    (text/tokenization.py's hf_tokenizer: lm-eval and batched generate need them, and no id is
    spare), which makes it a special token to transformers, and decode(skip_special_tokens=True)
    (the text-generation pipeline's and lm-eval's) dropped it from the text: every newline. Here
    no id is skipped, since every id is a character of the text."""

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return super()._decode(token_ids, skip_special_tokens=False, **kwargs)


MuGPTCharTokenizer.register_for_auto_class("AutoTokenizer")  # save_pretrained writes auto_map
