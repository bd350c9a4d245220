"""Numbers the sampler cannot hold are refused with a 400 naming the field, before admission;
stop_token_ids are capped by a flag; chat's default max_tokens is what the KV cache can serve."""
import httpx
import openai
import pytest

OK = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def raw(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "top_k": 9223372036854775808}', "top_k"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "top_k": 18446744073709551616}',
     "top_k"),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "top_k": 1537}', "top_k"),   # the vocabulary + 1
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "temperature": 1e999}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "top_p": NaN}', "top_p"),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "repetition_penalty": Infinity}',
     "repetition_penalty"),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "frequency_penalty": -Infinity}', "frequency_penalty"),
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "stop_token_ids": [9223372036854775808]}',
     "stop_token_ids"),
])
def test_numbers_out_of_range_are_a_400_naming_the_field(server, path, body, param):
    r = raw(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.post(server.url + "/v1/completions", json=OK).status_code == 200


def test_the_whole_vocabulary_as_top_k_is_served(server):
    r = httpx.post(server.url + "/v1/completions", json={**OK, "top_k": 1536, "temperature": 1.0})
    assert r.status_code == 200, r.text


def test_stop_token_ids_are_capped(server):
    over = httpx.post(server.url + "/v1/completions", json={**OK, "stop_token_ids": list(range(257))})
    assert over.status_code == 400 and over.json()["error"]["param"] == "stop_token_ids"
    assert "--max-stop-token-ids" in over.json()["error"]["message"]
    at = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stop_token_ids": list(range(256)),
                                                              "min_tokens": 2})
    assert at.status_code == 200, at.text


@pytest.fixture(scope="module")
def small_cache(start_server, tiny_llama):
    # 20 blocks of 16 = 320 tokens of KV cache, for a 1024-token context
    return start_server(tiny_llama, "--num-kv-blocks", "20", "--block-size", "16")


def test_chat_default_max_tokens_is_what_the_cache_can_serve(small_cache):
    client = openai.OpenAI(base_url=small_cache.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0,
                                       messages=[{"role": "user", "content": "Tell me a story."}],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 320   # the whole cache, not the whole context


def test_continue_final_message_is_refused_not_ignored(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert "not supported" in r.json()["error"]["message"]
