"""Blocks for the inference tier: where endpoints are (InferenceEndpoints) and how to start SGLang on SLURM."""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

from factory.inference.client import InferenceConfig
from factory.inference.sglang_slurm import SGLangLaunchSpec


class InferenceEndpointsBlock(Block):
    """Running inference endpoints a deployment samples from (the SLURM launch flow saves one of these)."""

    _block_type_name = "Factory Inference Endpoints"
    base_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000/v1"],
                                 description="Endpoint URLs (SGLang servers, a router, or OpenAI-compatible APIs).")
    model_name: str = Field("default", description="Model name sent in OpenAI-compatible requests.")
    server_type: Literal["sglang", "openai", "vllm"] = Field("sglang", description="sglang: native /generate and weight updates.")
    api_key: SecretStr = Field(SecretStr("x"), description="Bearer token for the endpoints.")
    num_max_requests_at_once: int = Field(64, ge=1, description="Most requests in flight per endpoint.")

    def inference_config(self, **overrides: object) -> InferenceConfig:
        """The client config for these endpoints; `overrides` set other InferenceConfig fields."""
        return InferenceConfig(base_url=self.base_urls, model_name=self.model_name, server_type=self.server_type,
                               api_key=self.api_key.get_secret_value(),
                               num_max_requests_at_once=self.num_max_requests_at_once, **overrides)


class SGLangClusterBlock(Block):
    """SGLang servers to start on SLURM: model, tp/dp, port, memory fraction, SLURM resources, launch command."""

    _block_type_name = "Factory SGLang Cluster"
    model_path: str = Field(description="HF model directory or hub id the servers load.")
    replicas: int = Field(1, ge=1, description="Server jobs to start (one node each).")
    tp: int = Field(1, ge=1, description="Tensor-parallel size per replica.")
    dp: int = Field(1, ge=1, description="Data-parallel size per replica.")
    port: int = Field(30000, description="Port of replica 0; replica i listens on port + i.")
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="SGLang --mem-fraction-static.")
    partition: str | None = Field(None, description="SLURM partition.")
    account: str | None = Field(None, description="SLURM account.")
    qos: str | None = Field(None, description="SLURM QOS.")
    time_limit: str = Field("04:00:00", description="SLURM --time per job.")
    gpus_per_node: int | None = Field(None, description="GPUs per job; default tp * dp.")
    cpus_per_task: int | None = Field(None, description="SLURM --cpus-per-task.")
    mem: str | None = Field(None, description="SLURM --mem.")
    extra_sbatch: list[str] = Field(default_factory=list, description="More sbatch options.")
    setup_commands: list[str] = Field(default_factory=list, description="Shell lines before the server starts.")
    extra_server_args: list[str] = Field(default_factory=list, description="More server arguments.")
    launch_command: str | None = Field(None, description="Replaces the sglang.launch_server command (see SGLangLaunchSpec).")
    use_router: bool = Field(False, description="Front the replicas with sglang_router.")
    router_port: int = Field(30100, description="Port of the router.")
    health_timeout_s: float = Field(1800.0, description="Seconds to wait for every replica to be healthy.")

    def spec(self) -> SGLangLaunchSpec:
        fields = set(SGLangLaunchSpec.model_fields) & set(type(self).model_fields)
        return SGLangLaunchSpec(**{name: getattr(self, name) for name in fields})
