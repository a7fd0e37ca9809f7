#!/usr/bin/env python3
"""The official `openai` Python client against a `kvr up` cluster running SmolLM2 on the CPU.

Checks, through the client's own API and exceptions:
  * non-streaming and streaming completions and chat completions return the same greedy text
    (temperature 0, fixed max_tokens) as `kvr generate --endpoint` over gRPC, with the same
    usage counts; stream_options.include_usage gives a last chunk with usage;
  * the "kvr" extension field selects the retrieval method and is reported back;
  * /v1/models lists the model; unknown model -> NotFoundError (404); n=2, chat logprobs and
    tools -> BadRequestError (400) naming the field; a wrong API key -> AuthenticationError
    (401) (the cluster runs with KVR_CONTROLLER_API_KEY set);
  * the API is HTTPS with the CA `kvr up` made (the client trusts it through
    http_client=openai.DefaultHttpxClient(verify=CA), the client's own httpx); a plaintext
    request to that port and a client that trusts only the system's CAs both fail to connect
    (APIConnectionError);
  * a client that closes a stream mid-way frees its sequence: the store holds no sequence
    within 1 s (kvr_store_sequences - kvr_store_cached_sequences on the store's /metrics; it is
    > 0 while the stream runs),
    and a follow-up request completes.

Usage: openai_client_test.py --kvr build/tools/kvr   (KVR_TEST_MODEL: the GGUF; exit 77 when
the model or the openai package is missing).
"""

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvr_up import MODEL, SKIP, Checks, Cluster, parse_args
API_KEY = "kvr-test-key"
PROMPT = "The capital of France is"
CHAT_PROMPT = "Name three colors."
MAX_TOKENS = 12

check = Checks()


def grpc_reference(kvr, cluster, prompt, chat):
    """(text, prompt_tokens, completion_tokens) from `kvr generate --endpoint`."""
    argv = [kvr, "generate", "--endpoint", cluster.grpc, *cluster.grpc_args, "--model", MODEL,
            "--prompt", prompt,
            "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    if chat:
        argv.append("--chat")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    text = out.stdout[:-1] if out.stdout.endswith("\n") else out.stdout  # it ends with "\n"
    prompt_tokens = int(re.search(r"prompt: (\d+) tokens", out.stderr).group(1))
    after_first = int(re.search(r"decode: (\d+) tokens after the first", out.stderr).group(1))
    return text, prompt_tokens, after_first + 1


def store_sequences(cluster):
    """Live sequences: those the store keeps for prefix reuse (cached) aside."""
    body = urllib.request.urlopen(f"http://{cluster.store_metrics}/metrics", timeout=5).read()

    def gauge(name):
        m = re.search(rb"^" + name + rb"(?:\{[^}]*\})? (\S+)$", body, re.M)
        return float(m.group(1))
    return gauge(b"kvr_store_sequences") - gauge(b"kvr_store_cached_sequences")


def main():
    args = parse_args()
    if args is None:
        return SKIP
    try:
        import openai
    except ImportError:
        print("skip: the openai package is missing (scripts/python-env.sh installs it)")
        return SKIP

    check.start = time.time()
    with tempfile.TemporaryDirectory(prefix="kvr-openai-") as log_dir:
        cluster = Cluster(args.kvr, log_dir, ["--store-capacity", "1GiB"],
                          env=dict(os.environ, KVR_CONTROLLER_API_KEY=API_KEY))
        try:
            run(openai, args.kvr, cluster)
        finally:
            cluster.stop()
    return check.result()


def run(openai, kvr, cluster):
    def client_for(base_url, api_key=API_KEY, verify=None):
        return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60,
                             http_client=openai.DefaultHttpxClient(verify=verify or cluster.ca))

    client = client_for(cluster.base_url)

    # HTTPS with kvr up's CA; nothing else gets through.
    check(cluster.base_url.startswith("https://") and cluster.ca is not None,
          f"kvr up serves HTTPS with its CA: {cluster.base_url} (CA {cluster.ca})")
    for what, other in (
            ("plaintext HTTP to the HTTPS port",
             client_for(cluster.base_url.replace("https://", "http://", 1))),
            ("a client that trusts only the system's CAs",
             client_for(cluster.base_url, verify=True))):
        try:
            other.models.list()
            check(False, f"{what}: no error")
        except openai.APIConnectionError as e:
            cause = repr(e.__cause__)
            check("CERTIFICATE_VERIFY_FAILED" in cause if "system" in what else True,
                  f"{what}: APIConnectionError ({cause[:120]})")
        except Exception as e:  # noqa: BLE001 (report whatever else came)
            check(False, f"{what}: got {type(e).__name__}: {e}")

    # Models.
    ids = [m.id for m in client.models.list().data]
    check(MODEL in ids, f"/v1/models lists {MODEL}: {ids}")

    # Completions, whole and streamed, against gRPC.
    text, p_tok, c_tok = grpc_reference(kvr, cluster, PROMPT, chat=False)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"kvr": {"method": "full"}})
    check(r.choices[0].text == text, f"completion text {r.choices[0].text!r} == gRPC {text!r}")
    check((r.usage.prompt_tokens, r.usage.completion_tokens) == (p_tok, c_tok),
          f"completion usage {r.usage.prompt_tokens}/{r.usage.completion_tokens} == "
          f"gRPC {p_tok}/{c_tok}")
    check(r.choices[0].finish_reason in ("length", "stop"), "completion finish_reason")
    kvr_report = (r.model_extra or {}).get("kvr", {})
    check(kvr_report.get("method") == "full" and kvr_report.get("budget", 0) > 0,
          f"response reports kvr method/budget: {kvr_report.get('method')}/"
          f"{kvr_report.get('budget')}")
    streamed, usage = "", None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            streamed += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    check(streamed == text, f"streamed completion {streamed!r} == gRPC")
    check(usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (p_tok, c_tok),
          f"streamed completion usage == gRPC {p_tok}/{c_tok}")

    # Chat, whole and streamed, against `kvr generate --chat`.
    text, p_tok, c_tok = grpc_reference(kvr, cluster, CHAT_PROMPT, chat=True)
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0)
    check(r.choices[0].message.content == text,
          f"chat text {r.choices[0].message.content!r} == gRPC {text!r}")
    check(r.choices[0].message.role == "assistant", "chat message role")
    check((r.usage.prompt_tokens, r.usage.completion_tokens) == (p_tok, c_tok),
          f"chat usage {r.usage.prompt_tokens}/{r.usage.completion_tokens} == gRPC "
          f"{p_tok}/{c_tok}")
    streamed, usage, roles = "", None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages,
                                                max_completion_tokens=MAX_TOKENS, temperature=0,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            if chunk.choices[0].delta.role:
                roles.append(chunk.choices[0].delta.role)
        if chunk.usage is not None:
            usage = chunk.usage
    check(streamed == text, f"streamed chat {streamed!r} == gRPC")
    check(roles == ["assistant"], f"streamed chat opens with the assistant role: {roles}")
    check(usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (p_tok, c_tok),
          "streamed chat usage == gRPC")

    # Errors, as the client raises them.
    def expect(exc_type, status, param, call, what):
        try:
            call()
        except exc_type as e:
            check(e.status_code == status and (param is None or e.param == param),
                  f"{what}: {type(e).__name__} {e.status_code} param={e.param}")
            return
        except Exception as e:  # noqa: BLE001 (report whatever else came)
            check(False, f"{what}: got {type(e).__name__}: {e}")
            return
        check(False, f"{what}: no error")

    expect(openai.NotFoundError, 404, "model",
           lambda: client.completions.create(model="no-such-model", prompt="x", max_tokens=2),
           "unknown model")
    expect(openai.BadRequestError, 400, "n",
           lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2),
           "n=2")
    expect(openai.BadRequestError, 400, "logprobs",
           lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                  logprobs=True), "chat logprobs")
    expect(openai.BadRequestError, 400, "tools",
           lambda: client.chat.completions.create(
               model=MODEL, messages=messages, max_tokens=2,
               tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
           "tools")
    expect(openai.BadRequestError, 400, "kvr.method",
           lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                             extra_body={"kvr": {"method": "no-such"}}),
           "unknown retrieval method")
    bad_key = client_for(cluster.base_url, api_key="wrong")
    expect(openai.AuthenticationError, 401, None,
           lambda: bad_key.completions.create(model=MODEL, prompt="x", max_tokens=2), "bad key")
    expect(openai.AuthenticationError, 401, None, lambda: bad_key.models.list(),
           "bad key on /v1/models")

    # A client that closes its stream mid-way frees the sequence within 1 s.
    check(store_sequences(cluster) == 0, "store idle before the long stream")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = 0
    for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    held = store_sequences(cluster)
    check(held > 0, f"the store holds the streaming sequence ({held})")
    stream.close()
    closed = time.time()
    freed_after = None
    while time.time() - closed < 1.0:
        if store_sequences(cluster) == 0:
            freed_after = time.time() - closed
            break
        time.sleep(0.02)
    check(freed_after is not None,
          f"closing the stream freed the sequence within 1 s ({freed_after})")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    check(r.usage.completion_tokens == 4, "a follow-up request completes")


if __name__ == "__main__":
    sys.exit(main())
