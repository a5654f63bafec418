"""A schema fuzz run (schemathesis) over the server's own /openapi.json, on a tiny model: bodies the
document allows and bodies it does not, boundary values included; no request gets a 5xx, and every
answer has a status the document declares and a body (or each server-sent event) matching its schema.
Bounded: a fixed number of examples per operation, derandomized, each generating at most a few tokens."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT

EXAMPLES_PER_OPERATION = 20


@pytest.fixture(scope="module")
def api_schema(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(block_size=16, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=256))
    config = ServerConfig(served_model_name="tiny", max_tokens_cap=2, request_timeout=20)
    with running_server(build_app(engine, config)) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        schema.config.generation.update(modes=list(GenerationMode))
        yield schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    case.call_and_validate(timeout=TIMEOUT,
                           checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance])
