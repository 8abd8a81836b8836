"""A chat template that refuses the messages (a role it does not know, an order it forbids) is
a 400 naming ``messages``, not a 500."""

from __future__ import annotations

from tests.reliability.conftest import running_replica, toy_config

REFUSING = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


def test_a_template_refusal_is_a_400_naming_messages():
    with running_replica(toy_config()) as replica:
        tokenizer = replica.runtime.engine.tokenizer
        before, tokenizer.chat_template = tokenizer.chat_template, REFUSING
        try:
            tool = {"role": "tool", "content": "42", "tool_call_id": "c1"}
            messages = [{"role": "user", "content": "hi"}, tool]
            body = {"model": "osd", "messages": messages, "max_tokens": 4}
            refused = replica.client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "messages" and "tool messages" in error["message"]
            body["messages"] = messages[:1]
            assert replica.client.post("/v1/chat/completions", json=body).status_code == 200
        finally:
            tokenizer.chat_template = before
