"""Stand-ins for captured CUDA graphs, so the replay path (buffers filled and padded to a graph's
size) runs through the real kernels on any device, and a count of the graphs an engine replays."""
from tritonllm import LLM
from tritonllm.engine.graphs import StepGraphs


class EagerReplay:
    """A stand-in for graph `key` of `graphs`: replay() runs the forward on the graph's buffers, as
    the captured launches would."""

    def __init__(self, graphs: StepGraphs, key: tuple[int, int]):
        g, tokens, context = graphs.inputs, graphs.tokens(key), graphs.context(*key)
        self.run = lambda: graphs.output[:tokens].copy_(graphs.forward(g["token_ids"][:tokens],
                                                                       g["positions"][:tokens], context))

    def replay(self):
        self.run()


def stand_in(graphs: StepGraphs) -> StepGraphs:
    """graphs with an EagerReplay for each of its keys."""
    graphs.graphs = {key: EagerReplay(graphs, key) for key in graphs.keys}
    return graphs


def count_replays(llm: LLM, kind: str = "prefill") -> list[tuple[int, int]]:
    """The keys of the `kind` ("prefill" or "decode") graphs llm replays from now on, in order."""
    graphs, replayed = getattr(llm.runner, f"{kind}_graphs"), []
    replay = graphs.replay

    def counted(inputs, token_ids, key, to_device):
        replayed.append(key)
        return replay(inputs, token_ids, key, to_device)

    graphs.replay = counted
    return replayed
