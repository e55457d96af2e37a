"""An instant OpenAI-compatible chat server for the datagen benchmark: answers at once with varied tagged numbers.

Each choice is `<answer>N</answer>` with N one of a few values around the
right sum, so groups usually have differing scores (neither side drops them).
N is a function of the prompt and the choice's index (not of arrival order),
so two runs over the same items write the same rows (bench.datagen.stages
checks that by content hash).
Raw asyncio HTTP/1.1 with keep-alive, each answer kept by its request (the
bench asks the same requests every round): the server costs far less than
either client, so the clients' own overhead is what the benchmark compares. With
`--workers N` N processes share the port (SO_REUSEPORT); the bench picks the
fastest setting for the raw limit and uses it for every side.

With `--tokenizer PATH` a request that asks for `return_token_ids` (as vLLM's
chat API takes it) gets the prompt's ids (`prompt_token_ids`, top level) and
each choice's (`token_ids`), as vLLM returns them: the ids the policy's
tokenizer gives the templated prompt and each answer plus EOS, i.e. the same
ids a client that tokenizes locally computes, so both modes write the same
rows. Requests that do not ask get no ids. The server keeps the ids it made
(by prompt and by answer), so it stays far cheaper than the clients. With
`--tokenizer` it also answers SGLang's `/generate` on token ids (the default
deployments' path): the prompt's user message is decoded from the ids, so it
gets the same answers, ids and rows as the chat calls.

    python -m bench.datagen.instant_server --port 31500 [--tokenizer bench/out/datagen/tiny-policy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import zlib

_NUMBERS = re.compile(r"(\d+)\+(\d+)")


class TokenIds:
    """Token ids as a server with the policy's tokenizer returns them: the templated prompt's and each answer's."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos = self.tokenizer.eos_token_id
        self._prompts: dict[str, list[int]] = {}
        self._answers: dict[str, list[int]] = {}
        self._users: dict[tuple[int, ...], str] = {}

    def prompt(self, messages: list[dict]) -> list[int]:
        key = json.dumps(messages)
        ids = self._prompts.get(key)
        if ids is None:
            if len(self._prompts) > 100_000:
                self._prompts.clear()
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self._prompts[key] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def user_text(self, input_ids: list[int]) -> str:
        """The last user message of a templated prompt given as ids (SGLang's /generate): decoded, then cut out of
        the template (the bench policy's `<|im_start|>user ... <|im_end|>` turns), so a prompt gets the same answers
        as the same messages sent to /v1/chat/completions."""
        key = tuple(input_ids)
        text = self._users.get(key)
        if text is None:
            if len(self._users) > 100_000:
                self._users.clear()
            decoded = self.tokenizer.decode(input_ids, skip_special_tokens=False)
            text = decoded.rpartition("<|im_start|>user\n")[2].partition("<|im_end|>")[0]
            self._users[key] = text
        return text

    def answer(self, text: str) -> list[int]:
        ids = self._answers.get(text)
        if ids is None:
            ids = self._answers[text] = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]
        return ids


TOKEN_IDS: TokenIds | None = None


def answers(text: str, n: int) -> list[str]:
    """The n answers to a user message: a function of its text and the choice's index only."""
    found = _NUMBERS.search(text)
    right = int(found.group(1)) + int(found.group(2)) if found else 4
    offsets = [(0, 0, 1, -1)[zlib.crc32(f"{text}|{i}".encode()) % 4] for i in range(n)]
    return [f"<answer>{right + offset}</answer>" for offset in offsets]


def chat_response(body: dict) -> dict:
    n = int(body.get("n") or 1)
    choices = [{"index": i, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
               for i, answer in enumerate(answers(body["messages"][-1]["content"], n))]
    usage = {"prompt_tokens": 16, "completion_tokens": 6 * n, "total_tokens": 16 + 6 * n}
    answer = {"id": "bench", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
              "choices": choices, "usage": usage}
    if TOKEN_IDS is not None and body.get("return_token_ids"):
        answer["prompt_token_ids"] = TOKEN_IDS.prompt(body["messages"])
        for choice in choices:
            choice["token_ids"] = TOKEN_IDS.answer(choice["message"]["content"])
    return answer


def generate_response(body: dict) -> list[dict] | dict:
    """SGLang's /generate on token ids (needs --tokenizer): one dict per sample, a list when n > 1. No logprobs,
    whatever `return_logprob` says, so the rows equal the chat sides' (which get none either)."""
    if TOKEN_IDS is None:
        raise ValueError("/generate needs the server started with --tokenizer")
    params = body.get("sampling_params") or {}
    n = int(params.get("n") or 1)
    ids = body["input_ids"]
    samples = []
    for answer in answers(TOKEN_IDS.user_text(ids), n):
        output = TOKEN_IDS.answer(answer)
        samples.append({"text": answer, "output_ids": output,
                        "meta_info": {"id": "bench", "finish_reason": {"type": "stop", "matched": TOKEN_IDS.eos},
                                      "prompt_tokens": len(ids), "completion_tokens": len(output)}})
    return samples if n > 1 else samples[0]


ANSWER_CACHE_MAX = 100_000
"""Encoded answers kept per worker, by (path, request body). The bench sends the same requests round after round
(every side calls the same items), and building an answer with token ids cost this server 160-270 us of CPU a
request (more than the flow's client), on the 2 cores the clients run on. A cached answer costs a lookup. A run
of G groups keeps about G answers (1-2 KB each) per kind of request: chat with and without ids, /generate, and
Atropos's bodies."""

_answers: dict[tuple[str, bytes], bytes] = {}


def encoded_answer(method: str, path: str, raw: bytes) -> bytes:
    """The whole HTTP answer to one request: status line, headers and JSON body."""
    if path.endswith("/chat/completions") and method == "POST":
        status, payload = 200, chat_response(json.loads(raw))
    elif path == "/generate" and method == "POST":
        status, payload = 200, generate_response(json.loads(raw))
    elif path in ("/health", "/v1/models", "/models"):
        status, payload = 200, {"object": "list", "data": [{"id": "m", "object": "model"}]}
    else:
        status, payload = 404, {"error": f"no route {path}"}
    data = json.dumps(payload).encode()
    return (f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            raw = await reader.readexactly(int(headers.get("content-length", 0)))
            key = (f"{method} {path}", raw)
            answer = _answers.get(key)
            if answer is None:
                answer = encoded_answer(method, path, raw)
                if len(_answers) < ANSWER_CACHE_MAX:
                    _answers[key] = answer
            writer.write(answer)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionResetError, ValueError):
        pass
    finally:
        writer.close()


async def serve(port: int, parent: int) -> None:
    """Serve until the process that started this one is gone (a killed bench leaves no server behind)."""
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024, reuse_port=True)
    async with server:
        while os.getppid() == parent:
            await asyncio.sleep(1)


def _worker(port: int, parent: int, tokenizer: str | None) -> None:
    global TOKEN_IDS
    if tokenizer:
        TOKEN_IDS = TokenIds(tokenizer)
    asyncio.run(serve(port, parent))


def _stop(*_args) -> None:
    """SIGTERM: take the worker processes down too, then leave at once (no traceback from the open connections)."""
    for child in multiprocessing.active_children():
        child.terminate()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--tokenizer", help="answer `return_token_ids` requests with ids from this tokenizer")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)
    for _ in range(args.workers - 1):
        multiprocessing.Process(target=_worker, args=(args.port, os.getpid(), args.tokenizer), daemon=True).start()
    _worker(args.port, os.getppid(), args.tokenizer)


if __name__ == "__main__":
    main()
