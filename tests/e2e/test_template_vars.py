"""A request's reasoning effort and verbosity reach the chat template as variables, and an assistant turn's
thoughts as its `reasoning_content` (issue 47), on every API.

The server runs a tiny random Llama whose chat template writes `reasoning_effort`, `enable_thinking` and
`verbosity` into the prompt when they are defined (as reasoning models' templates read them); the prompt's
token count each API reports must be that of the template rendered here with the same variables.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import EXTERNAL_URL
from tests.e2e.server_utils import ServerProcess
from tests.random_llama import save_random_llama

TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "{% if enable_thinking is defined %} thinking={{ enable_thinking }}{% endif %}<|im_end|>\n{% endif %}"
    "{%- if verbosity is defined %}<|im_start|>system\nVerbosity: {{ verbosity }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from runtime.models.model_loader import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, tokenizer):
    if EXTERNAL_URL:
        pytest.skip("needs its own server (a model with a template that reads the variables)")
    model = save_random_llama(
        tmp_path_factory.mktemp("template_vars"),
        tokenizer,
        seed=0,
        std=0.3,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    srv = ServerProcess(model=model, extra_args=["--max-total-tokens", "4000"]).start()
    try:
        yield srv.url
    finally:
        assert srv.stop() == 0, srv.log_tail()


def rendered_len(tokenizer, messages=USER, **variables) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_completions(oai, tokenizer):
    def prompt_tokens(**kw) -> int:
        out = oai.chat.completions.create(model="default", messages=USER, max_tokens=1, **kw)
        return out.usage.prompt_tokens

    plain = prompt_tokens()
    assert plain == rendered_len(tokenizer)
    assert prompt_tokens(reasoning_effort="high") == rendered_len(tokenizer, reasoning_effort="high") > plain
    assert prompt_tokens(reasoning_effort="none") == rendered_len(
        tokenizer, reasoning_effort="none", enable_thinking=False
    )
    assert prompt_tokens(verbosity="low") == rendered_len(tokenizer, verbosity="low") > plain


def test_responses(oai, tokenizer):
    def prompt_tokens(**kw) -> int:
        out = oai.responses.create(model="default", input=USER, max_output_tokens=1, **kw)
        return out.usage.input_tokens

    assert prompt_tokens() == rendered_len(tokenizer)
    assert prompt_tokens(reasoning={"effort": "minimal"}) == rendered_len(
        tokenizer, reasoning_effort="minimal"
    )
    both = rendered_len(tokenizer, reasoning_effort="low", verbosity="high")
    assert prompt_tokens(reasoning={"effort": "low"}, text={"verbosity": "high"}) == both


def test_messages(claude, tokenizer):
    def prompt_tokens(**kw) -> int:
        out = claude.messages.create(model="default", messages=USER, max_tokens=1, **kw)
        counted = claude.messages.count_tokens(model="default", messages=USER, **kw).input_tokens
        assert counted == out.usage.input_tokens + out.usage.cache_read_input_tokens
        return counted

    assert prompt_tokens() == rendered_len(tokenizer)
    assert prompt_tokens(output_config={"effort": "max"}) == rendered_len(tokenizer, reasoning_effort="max")
    assert prompt_tokens(thinking={"type": "disabled"}) == rendered_len(tokenizer, enable_thinking=False)


THOUGHTFUL = [
    *USER,
    {"role": "assistant", "content": "Hi.", "reasoning_content": "A greeting."},
    {"role": "user", "content": "Again."},
]


def test_thoughts_in_history_reach_the_template(oai, claude, tokenizer):
    """Thoughts sent back in an assistant turn (chat's reasoning_content, a Responses reasoning item,
    a Messages thinking block) reach the template, which renders them as it defines."""
    wanted = rendered_len(tokenizer, THOUGHTFUL)
    assert wanted > rendered_len(
        tokenizer, [{k: v for k, v in m.items() if k != "reasoning_content"} for m in THOUGHTFUL]
    )
    chat = oai.chat.completions.create(model="default", messages=THOUGHTFUL, max_tokens=1)
    assert chat.usage.prompt_tokens == wanted
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "A greeting."}],
    }
    items = [*USER, thought, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]
    assert (
        oai.responses.create(model="default", input=items, max_output_tokens=1).usage.input_tokens == wanted
    )
    turn = [{"type": "thinking", "thinking": "A greeting.", "signature": ""}, {"type": "text", "text": "Hi."}]
    history = [*USER, {"role": "assistant", "content": turn}, {"role": "user", "content": "Again."}]
    assert claude.messages.count_tokens(model="default", messages=history).input_tokens == wanted
