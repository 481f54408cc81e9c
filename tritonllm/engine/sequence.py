from enum import Enum, auto
from itertools import count

from tritonllm.sampling_params import SamplingParams

PENDING = -1  # a sampled token still on its way from the GPU (the engine runs one step ahead)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, its cache blocks and how far its KV has been computed."""

    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_table_array = None  # the model runner's int32 copy: (the list it copies, the array)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        """The sampled tokens known on the host (without trailing PENDING placeholders)."""
        ids = self.token_ids[self.num_prompt_tokens:]
        while ids and ids[-1] == PENDING:
            ids.pop()
        return ids

    @property
    def num_completion_tokens(self) -> int:
        """Sampled tokens, those still pending included."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    def reaches_end(self, num_new: int) -> bool:
        """Whether computing num_new more tokens reaches the last one, so a token is sampled."""
        return self.num_computed_tokens + num_new == len(self.token_ids)

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
