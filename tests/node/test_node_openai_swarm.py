"""The official openai client streams a chat completion from a backbone serving a local swarm."""

from __future__ import annotations

import openai
import pytest

from moeswarm.demo import CHECKPOINT
from moeswarm.demo.swarm import start_daemon, stop_daemon
from moeswarm.model import SamplingParams, Tokenizer, generate, load_model

pytestmark = pytest.mark.slow


def test_openai_client_streams_from_a_local_swarm() -> None:
    daemons = []
    client = None
    try:
        daemons.append(start_daemon("node0", ["node", "--model", str(CHECKPOINT), "--experts", "0-3"]))
        boot = daemons[0].info["multiaddrs"][0]
        daemons.append(start_daemon("node1", ["node", "--model", str(CHECKPOINT), "--experts", "4-7", "--bootstrap", boot]))
        backbone = start_daemon("backbone", ["backbone", "--model", str(CHECKPOINT), "--bootstrap", boot,
                                             "--http", "127.0.0.1:0"])
        daemons.append(backbone)
        client = openai.OpenAI(base_url=backbone.info["http"] + "/v1", api_key="unused", timeout=60)
        models = [m.id for m in client.models.list().data]
        assert models == [backbone.info["model_id"]]

        chunks = client.chat.completions.create(
            model=models[0], messages=[{"role": "user", "content": "Who led Israel out of Egypt?"}],
            max_tokens=20, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client.chat.completions.create(
            model=models[0], messages=[{"role": "user", "content": "Who led Israel out of Egypt?"}],
            max_tokens=20, temperature=0)
        assert streamed and streamed == whole.choices[0].message.content

        # the swarm's completion equals the single-process engine's
        prompt = "And it came to pass"
        completion = client.completions.create(model=models[0], prompt=prompt, max_tokens=16, temperature=0)
        model = load_model(CHECKPOINT)
        tok = Tokenizer.from_folder(CHECKPOINT, model.config.bos_token_id)
        ids = tok.encode(prompt)
        local = list(generate(model, ids, SamplingParams(max_new_tokens=16, stop_token_ids=model.config.eos_token_ids)))
        assert completion.choices[0].text == tok.decode(ids + local)[len(tok.decode(ids)):]
    finally:
        if client is not None:
            client.close()  # its pooled connection, else closed only when collected (a ResourceWarning later on)
        for d in reversed(daemons):
            stop_daemon(d)


def test_sdk_client_with_bootstrap_runs_a_backbone_in_process() -> None:
    from moeswarm.sdk import Client

    daemons = []
    try:
        daemons.append(start_daemon("node0", ["node", "--model", str(CHECKPOINT)]))
        boot = daemons[0].info["multiaddrs"][0]
        with Client(bootstrap=boot, model_dir=str(CHECKPOINT)) as client:
            text = client.generate("And it came to pass", max_new_tokens=12)
            pieces = list(client.generate("And it came to pass", max_new_tokens=12, stream=True))
        assert text and "".join(pieces) == text
    finally:
        for d in daemons:
            stop_daemon(d)
