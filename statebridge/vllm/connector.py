"""``StatebridgeConnector``: a vLLM v1 KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

vLLM builds one per role: in the scheduler process (role SCHEDULER) it speaks vLLM's request
lifecycle; in every worker (role WORKER) it owns an :class:`~statebridge.vllm.agent.Agent`, the
data-plane thread over the registered caches.

Who calls what, and when (vLLM 0.32)::

    scheduler   on_new_request            producer: drop the prompt's last token (the N-1 rule:
                                          the decode instance recomputes it from h(N-1))
                get_num_new_matched_tokens consumer: N-1 tokens arrive, asynchronously
                update_state_after_alloc  consumer: the blocks they land in
                build_connector_meta      -> the workers: loads to start, requests to hold
                request_finished_all_groups producer: keep the blocks, return kv_transfer_params
    worker      register_kv_caches        describe the caches, start the agent
                start_load_kv / wait_for_save  hand the step's loads and holds to the agent
                get_transfer_results      what finished sending / receiving / failed

The decode instance learns where the state is from ``kv_transfer_params`` (what the producer's
``request_finished_all_groups`` returns; a proxy passes it through unchanged), in the shape
vLLM's own connectors use: ``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``,
``remote_host``, ``remote_port``, ``remote_block_ids``, ``tp_size``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from statebridge.errors import UnsupportedModelError
from statebridge.vllm.agent import Agent, Load
from statebridge.vllm.settings import Settings

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Under "vllm.": vLLM's handlers print it beside its own lines (a library configures none).
log = logging.getLogger("vllm." + __name__)

__all__ = ["StatebridgeConnector", "StatebridgeMetadata", "worker_counters"]

#: The worker process's GIL switch interval with the connector (see register_kv_caches).
SWITCH_INTERVAL_S = 0.0002
#: The longest a worker's step that computes nothing waits for an open transfer to end; a new
#: request reaching the engine then starts at most this much later (only while it is idle).
IDLE_WAIT_S = 0.01


def worker_counters(worker) -> dict:
    """This worker rank's connector counters (transfers, bytes, messages, kept KV blocks):
    ``LLM.collective_rpc(worker_counters)`` gives one dict per rank ({} without an agent)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    agent = getattr(get_kv_transfer_group(), "agent", None)
    return dict(agent.counters) if agent is not None else {}


@dataclass
class StatebridgeMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: loads to start and requests to hold."""

    loads: list = field(default_factory=list)          # Load (without runtime fields)
    holds: list = field(default_factory=list)          # request ids
    idle: bool = False                                 # the step computes no token


def _groups(kv_cache_config) -> list[tuple[str, Any]]:
    """vLLM's transfer groups as ``(kind, group)``; a kind statebridge does not move is refused
    here, naming it."""
    out = []
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            out.append(("mamba", group))
        elif type(spec) is FullAttentionSpec:
            out.append(("attention", group))
        else:
            raise UnsupportedModelError(f"statebridge connector: vLLM cache group of layers "
                                        f"{list(group.layer_names)} is a {type(spec).__name__}, "
                                        f"which statebridge does not move")
    return out


class StatebridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """statebridge inside vLLM (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = Settings.from_extra(transfer.kv_connector_extra_config)
        self.engine_id = str(transfer.engine_id)
        self.producer = transfer.is_kv_producer
        self.consumer = transfer.is_kv_consumer
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._groups = _groups(kv_cache_config) if kv_cache_config is not None else []
        # scheduler side
        self._loads: list[Load] = []
        self._holds: list[str] = []
        # worker side
        self.agent: Agent | None = None
        self._idle_step = False

    # ==== scheduler side ===================================================================
    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or params.get("_sb_truncated"):
            return
        if request.num_prompt_tokens > 1 and request.prompt_token_ids is not None:
            # The N-1 rule: this instance computes h(N-1); the decode instance runs the last
            # prompt token itself (a recurrent state has no way to take a token back).
            del request.prompt_token_ids[-1:]
            del request._all_token_ids[-1:]
            request.num_prompt_tokens -= 1
            request.max_tokens = 1
            params["_sb_truncated"] = True

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # The request's own blocks of every transfer group are restored, recurrent ones too.
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        load = self._load(request, params, abort=num_external_tokens == 0)
        if load is not None:
            if not load.abort:
                load.local_blocks = self._clip(blocks.get_block_ids())
                # this instance's prefix cache hit (full blocks): its KV stays as it is
                load.computed_tokens = max(0, load.tokens - num_external_tokens)
            self._loads.append(load)

    def _load(self, request: "Request", params: dict, *, abort: bool) -> Load | None:
        try:
            return Load(request_id=request.request_id,
                        remote_request_id=str(params["remote_request_id"]),
                        engine_id=str(params["remote_engine_id"]),
                        host=str(params["remote_host"]), port=int(params["remote_port"]),
                        remote_tp=int(params["tp_size"]),
                        remote_blocks=tuple(tuple(int(b) for b in g)
                                            for g in params["remote_block_ids"]),
                        local_blocks=(), tokens=len(request.prompt_token_ids or ()) - 1,
                        abort=abort)
        except (KeyError, TypeError, ValueError) as e:
            log.error("statebridge connector: request %s has malformed kv_transfer_params "
                      "(%s: %s): %s; it is prefilled here", request.request_id,
                      type(e).__name__, e, params)
            return None

    def _clip(self, block_ids) -> tuple:
        """Per transfer group: a recurrent group's one state block, an attention group's
        table."""
        selected = self._kv_cache_config.select_transfer_block_ids(block_ids)
        out = []
        for (kind, group), blocks in zip(self._groups, selected):
            if kind == "mamba":
                blocks = clip_ssm_state_blocks(list(blocks),
                                               group.kv_cache_spec.num_speculative_blocks)
            out.append(tuple(int(b) for b in blocks))
        return tuple(out)

    def build_connector_meta(self, scheduler_output) -> StatebridgeMetadata:
        meta = StatebridgeMetadata(loads=self._loads, holds=self._holds,
                                   idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads, self._holds = [], []
        return meta

    def request_finished(self, request: "Request", block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids):
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # A decode request that ended before it was scheduled: release the producer.
            params["do_remote_prefill"] = False
            load = self._load(request, params, abort=True)
            if load is not None:
                self._loads.append(load)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None
        clipped = self._clip(block_ids)
        if not any(clipped):
            return False, None
        self._holds.append(request.request_id)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": self.settings.host, "remote_port": self.settings.port,
            "remote_block_ids": [list(g) for g in clipped], "tp_size": self.tp_size,
            "transfer": "statebridge",
            # What this instance's prefix cache now holds of the prompt (its full blocks), for
            # a router (statebridge proxy) to send the prompt's next turn here.
            "cached_prefix_tokens": (request.num_computed_tokens // self.block_size
                                     * self.block_size if self._prefix_caching else 0),
        }

    # ==== worker side ======================================================================
    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        from statebridge.vllm.describe import describe

        layers = describe(self._vllm_config.model_config.model, self._groups, kv_caches,
                          self.tp_size, str(get_conv_state_layout()))
        rank = get_tensor_model_parallel_rank()
        # vLLM's worker thread spins (sched_yield) for a second after each step, and a request
        # waiting for its state keeps the engine stepping; every zmq or UCX call of the agent
        # thread then waits up to the switch interval for the GIL (5 ms by default: seconds
        # per load under `vllm serve`, measured). A shorter interval bounds that wait.
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.agent = Agent(layers, tp_rank=rank, tp_size=self.tp_size,
                           engine_id=self.engine_id, producer=self.producer,
                           consumer=self.consumer, settings=self.settings)
        log.info("statebridge connector rank %d of %d (%s%s): %s, conv layout %s, %d layers "
                 "in %d cache groups; side channel %s:%d", rank, self.tp_size,
                 "producer" if self.producer else "", "+consumer" if self.consumer and
                 self.producer else ("consumer" if self.consumer else ""),
                 layers.spec.model_type, layers.geometry.conv_layout,
                 len(layers.geometry.slots), len(layers.groups), self.settings.host,
                 self.settings.port + rank)

    def _take_metadata(self) -> None:
        if self.agent is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if getattr(meta, "_sb_taken", False):
            return
        meta._sb_taken = True
        self._idle_step = meta.idle
        for request_id in meta.holds:
            self.agent.hold(request_id)
        if meta.loads or meta.holds:
            log.debug("statebridge connector: step hands over %d loads, %d holds",
                      len(meta.loads), len(meta.holds))
        for load in meta.loads:
            self.agent.load(Load(**{k: getattr(load, k) for k in (
                "request_id", "remote_request_id", "engine_id", "host", "port", "remote_tp",
                "remote_blocks", "local_blocks", "tokens", "computed_tokens", "abort")}))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._take_metadata()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        self._take_metadata()

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        self._take_metadata()
        if self.agent is None:
            return KVConnectorTransferResults()
        if self._idle_step:
            # Nothing computes this step and vLLM steps again at once while transfers are
            # open (its workers spin on sched_yield between steps): sleep until one ends, at
            # most IDLE_WAIT_S, so that the data plane and the peer get the cores.
            self.agent.wait_for_transfers(IDLE_WAIT_S)
        sending, recving, failed = self.agent.take_finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None


