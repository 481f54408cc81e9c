from enum import Enum, auto
from itertools import count

from tritonllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, its cache blocks and how far its KV has been computed.

    The engine runs one step ahead of the host, so up to two sampled tokens can be on their way
    from the device: `token_ids` holds the known tokens only, `num_pending` counts the others.
    `len(seq)` counts both: it is the length the cache and the scheduler work with.

    A list it may never need is the empty tuple until it does: tens of thousands of requests can wait
    in the queue, and Python's full garbage collections walk every list each one holds.
    """

    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_pending = 0  # sampled tokens not yet on the host
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] | tuple = ()  # a list from the block manager while it holds blocks
        self.block_table_array = None  # the model runner's int32 copy: (the list it copies, the array)
        self.logit_bias_tensors = None  # the model runner's device copy of params.logit_bias: (ids, biases)
        self.allowed_ids_tensor = None  # likewise of params.allowed_token_ids
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens: int | None = None  # prompt tokens the first allocation found in the prefix cache
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.block_hashes: list[int] | tuple = ()  # the prefix-cache hash chain of its leading full blocks
        self.logprobs: list[float] | tuple = [] if params.wants_logprobs else ()
        self.top_logprobs: list[dict[int, float]] | tuple = [] if params.num_top_logprobs else ()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
        # With params.prompt_logprobs (the first sample of a request only): entry i scores prompt token
        # i + 1, from the logits at position i.
        scored = params.prompt_logprobs is not None
        self.prompt_logprobs: list[float] | None = [] if scored else None
        self.prompt_top_logprobs: list[dict[int, float]] | tuple = [] if params.prompt_logprobs else ()
        self.prompt_ranks: list[int] | tuple = [] if scored else ()

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions are still to be scored (such a prompt skips the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def completion_token_ids(self) -> list[int]:
        """The sampled tokens known on the host."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_known_completion_tokens(self) -> int:
        """len(completion_token_ids), without copying them (it is asked for every token)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        """Sampled tokens, those still pending included."""
        return len(self) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return -(-len(self) // self.block_size)

    def append_token(self, token_id: int) -> None:
        """A pending token reached the host (tokens arrive in the order they were sampled)."""
        self.token_ids.append(token_id)
        self.num_pending -= 1

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
