"""Pooling models (--runner pooling): embeddings equal sentence-transformers on the same checkpoint,
cross-encoder scores equal HF's LlamaForSequenceClassification, over LLM and over real HTTP with the
openai client, LangChain and LiteLLM; bad input is a 400 naming its field."""

import base64
import os

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer, models

from serve import LLM, EngineArgs
from tests.pooling_helpers import make_cross_encoder, make_embedder
from tests.server_helpers import MODEL_NAME, call, core_stats, running_server

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "pooling " * 40]
QUERY, DOCS = "what is a fox", ["a fox is an animal", "paris is in france", "foxes eat mice and berries"]
SMALL = dict(dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return make_embedder(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return make_cross_encoder(tmp_path_factory.mktemp("cross_encoder"))


def st_embeddings(path, pooling: str, normalize: bool) -> np.ndarray:
    pool = models.Pooling(64, pooling)
    modules = [models.Transformer(str(path)), pool, *([models.Normalize()] if normalize else [])]
    return SentenceTransformer(modules=modules, device="cpu").encode(TEXTS, convert_to_numpy=True)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def hf_scores(path, query: str, docs: list[str]) -> np.ndarray:
    model = transformers.LlamaForSequenceClassification.from_pretrained(path).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return np.array([torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits).item() for d in docs])


def hf_pair_ids(path, query: str, doc: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(path)(query, doc)["input_ids"]


@pytest.mark.parametrize("pooling", ["mean", "lasttoken", "cls"])
def test_llm_embed_equals_sentence_transformers(embedder, pooling):
    kind = {"mean": "MEAN", "lasttoken": "LAST", "cls": "CLS"}[pooling]
    llm = LLM(str(embedder), runner="pooling", pooler_config={"pooling_type": kind, "normalize": False}, **SMALL)
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    ref = st_embeddings(embedder, pooling, normalize=False)
    assert cosines(ours, ref).min() >= 0.9999
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    cut = np.array([o.outputs.embedding for o in llm.embed(TEXTS, dimensions=16)])
    np.testing.assert_allclose(cut, ours[:, :16], rtol=1e-5, atol=1e-6)  # a Matryoshka cut, unnormalized
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS, dimensions=65)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([[5] * 129])
    assert llm.engine.core.layout.num_blocks == 128 // 8  # no KV kept: the pool is one sequence's, not the 32 asked
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("hi")


def test_engine_args_name_the_bad_pooling_flag(embedder):
    with pytest.raises(ValueError, match="EngineArgs.runner"):
        EngineArgs(model=str(embedder), runner="embed")
    with pytest.raises(ValueError, match="EngineArgs.convert"):
        EngineArgs(model=str(embedder), runner="pooling", convert="classify")  # a causal LM has no score head
    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(model=str(embedder), runner="pooling", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="pooler_config takes"):
        EngineArgs(model=str(embedder), runner="pooling", pooler_config={"softmax": True})


def test_sentence_transformers_checkpoint(embedder, tmp_path):
    st = SentenceTransformer(
        modules=[models.Transformer(str(embedder)), models.Pooling(64, "mean"), models.Normalize()], device="cpu"
    )
    st.save(str(tmp_path))  # a bare LlamaModel, and modules.json + 1_Pooling/config.json: MEAN, normalized
    llm = LLM(str(tmp_path), runner="pooling", **SMALL)
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, rtol=1e-5)
    assert cosines(ours, st.encode(TEXTS, convert_to_numpy=True)).min() >= 0.9999


def test_llm_score_equals_hf_cross_encoder(cross_encoder):
    llm = LLM(str(cross_encoder), runner="pooling", **SMALL)
    ours = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    np.testing.assert_allclose(ours, hf_scores(cross_encoder, QUERY, DOCS), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="text_1"):
        llm.score(["a", "b"], DOCS)
    with pytest.raises(ValueError, match="embedding model"):
        llm.embed(TEXTS)


@pytest.fixture(scope="module")
def embed_server(embedder):
    mean = {"pooling_type": "MEAN"}
    with running_server(model=str(embedder), runner="pooling", pooler_config=mean, **SMALL) as (url, app):
        yield url, app


def test_openai_client_embeddings(embed_server, embedder):
    url, app = embed_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    ref = st_embeddings(embedder, "mean", normalize=True)
    got = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64
    assert [d.index for d in got.data] == [0, 1, 2, 3] and got.usage.prompt_tokens > len(TEXTS)
    assert cosines(np.array([d.embedding for d in got.data]), ref).min() >= 0.9999
    floats = client.embeddings.create(model=MODEL_NAME, input="hello world", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, ref[0], atol=1e-5)
    short = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2], dimensions=8).data
    cut = ref[:2, :8] / np.linalg.norm(ref[:2, :8], axis=-1, keepdims=True)  # Matryoshka: cut, then renormalize
    np.testing.assert_allclose([d.embedding for d in short], cut, atol=1e-5)
    ids = client.embeddings.create(model=MODEL_NAME, input=[[0, 76, 578, 83, 1173]], encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, floats.data[0].embedding, atol=1e-6)  # "hello world"'s ids
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another", input="hi")
    stats = core_stats(app)
    assert stats.num_free_blocks == stats.num_blocks  # pooling keeps no KV blocks
    call(app, "check_invariants")
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]


def test_langchain_and_litellm_embeddings(embed_server, embedder):
    url = embed_server[0]
    from langchain_openai import OpenAIEmbeddings

    ref = st_embeddings(embedder, "mean", normalize=True)
    lc = OpenAIEmbeddings(model=MODEL_NAME, base_url=f"{url}/v1", api_key="unused", check_embedding_ctx_length=False)
    assert cosines(np.array(lc.embed_documents(TEXTS)), ref).min() >= 0.9999
    assert cosines(np.array([lc.embed_query(TEXTS[1])]), ref[1:2]).min() >= 0.9999
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the price list at import
    import litellm

    out = litellm.embedding(model=f"openai/{MODEL_NAME}", api_base=f"{url}/v1", api_key="unused", input=TEXTS)
    assert cosines(np.array([d["embedding"] for d in out.data]), ref).min() >= 0.9999


def test_pooling_score_and_rerank_by_cosine(embed_server, embedder):
    url = embed_server[0]
    ref = st_embeddings(embedder, "mean", normalize=True)
    pooled = httpx.post(f"{url}/pooling", json={"input": TEXTS[:2], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(pooled["data"][1]["data"]), "<f4")
    np.testing.assert_allclose(vector, ref[1], atol=1e-5)
    body = httpx.post(f"{url}/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:3]}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], ref[1:3] @ ref[0], atol=1e-5)
    ranked = httpx.post(f"{url}/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]}).json()["results"]
    assert [r["index"] for r in ranked] == list(np.argsort(-(ref[1:] @ ref[0])))
    np.testing.assert_allclose([r["relevance_score"] for r in ranked], np.sort(ref[1:] @ ref[0])[::-1], atol=1e-5)


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": "word " * 300}, "input"),
        ("/v1/embeddings", {"input": [[99999]]}, "input"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 65}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(embed_server, route, body, param):
    r = httpx.post(f"{embed_server[0]}{route}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_cross_encoder_server_scores_and_reranks(cross_encoder):
    ref = hf_scores(cross_encoder, QUERY, DOCS)
    with running_server(model=str(cross_encoder), runner="pooling", api_key="k", **SMALL) as (url, _):
        auth = {"Authorization": "Bearer k"}
        assert httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS}).status_code == 401
        body = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCS}, headers=auth).json()
        np.testing.assert_allclose([d["score"] for d in body["data"]], ref, rtol=1e-4, atol=1e-6)
        ranked = httpx.post(
            f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}, headers=auth
        ).json()["results"]
        assert [r["index"] for r in ranked] == list(np.argsort(-ref)[:2])
        assert ranked[0]["document"]["text"] == DOCS[ranked[0]["index"]]
        np.testing.assert_allclose([r["relevance_score"] for r in ranked], np.sort(ref)[::-1][:2], rtol=1e-4)
        pairs = [hf_pair_ids(cross_encoder, QUERY, d) for d in DOCS]
        probs = httpx.post(f"{url}/pooling", json={"input": pairs}, headers=auth).json()["data"]
        np.testing.assert_allclose([d["data"][0] for d in probs], ref, rtol=1e-4, atol=1e-6)
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, headers=auth)
        assert refused.status_code == 400 and "classify" in refused.json()["error"]["message"]


def test_generate_server_refuses_pooling_routes():
    with running_server() as (url, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/rerank", json={"query": "q", "documents": ["d"]}).status_code == 400
