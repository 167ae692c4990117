"""The server's request parsing without a server (fast): a request body becomes the same
`GenerationConfig` the library and the CLI decode, defaults included (serving/api.py, inputs.py)."""

import pytest

from blockdraft.decoding.state import DEFAULT_TREE, GenerationConfig
from blockdraft.decoding.verify import SamplingParams
from blockdraft.serving.api import ApiError, parse_body
from blockdraft.serving.inputs import Inputs

from conftest import tiny_target


@pytest.fixture(scope="module")
def inputs():
    return Inputs(tiny_target("llama"), "tiny", default_max_tokens=16, lookup=True)


def prepare(inputs, **body):
    return inputs.prepare(parse_body({"model": "tiny", **body}, chat=False, model_name="tiny"))


def test_a_greedy_request_decodes_as_the_library_does_by_default(inputs):
    parsed = prepare(inputs, prompt=[5, 17, 33], max_tokens=8, temperature=0, stop="\n\n", seed=3)
    cfg = parsed.config
    assert parsed.prompt_ids == [5, 17, 33] and not parsed.stream
    assert (cfg.max_new_tokens, cfg.stop_strings, cfg.lookup) == (8, ("\n\n",), True)
    assert cfg.sampling == SamplingParams(0.0, 0, 1.0, 3)
    library = GenerationConfig()
    assert (cfg.tree_budget, cfg.coupling, cfg.block_size, cfg.adaptive) == \
        (library.tree_budget, library.coupling, library.block_size, library.adaptive)
    assert cfg.trees(True, inputs.target.supports_trees) == DEFAULT_TREE  # trees for greedy, as the CLI
    assert cfg.trees(False, True) is None  # no drafter: plain steps


def test_defaults_and_sampling_fields(inputs):
    cfg = prepare(inputs, prompt=[5, 17, 33], temperature=0.7, top_p=0.9).config
    assert cfg.max_new_tokens == 16 and cfg.sampling == SamplingParams(0.7, 0, 0.9, None)
    assert cfg.trees(True, True) is None  # sampled: chains, as the CLI decodes
    assert prepare(inputs, prompt=[5], temperature=1e-9).config.sampling.greedy  # as vLLM: greedy below 1e-5


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": [5, 17], "temperature": -1}, 400, "temperature"),
    ({"prompt": [5, 17], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [5, 10 ** 6]}, 400, "outside the vocabulary"),
    ({"prompt": [5, 17], "logprobs": 3}, 400, "not supported"),
    ({"prompt": [5, 17], "model": "other"}, 404, "does not exist"),
])
def test_bad_requests_are_refused_with_what_is_wrong(inputs, body, status, words):
    with pytest.raises(ApiError) as err:
        prepare(inputs, **body)
    assert err.value.status == status and words in str(err.value)


def test_serve_tree_option_reaches_every_request():
    chains = Inputs(tiny_target("llama"), "tiny", default_max_tokens=16, lookup=False, tree_budget=None)
    cfg = prepare(chains, prompt=[5, 17, 33], temperature=0).config
    assert cfg.tree_budget is None and cfg.trees(True, True) is None and not cfg.lookup  # `serve --tree 0`
