"""A prompt handed to the real router without its token ids: the router only counts a prompt's
tokens and passes it to its locator, and the simulator's locator knows the request it stands for."""

from __future__ import annotations

from pof_connector.sim.job import Job


class PromptRef(list[int]):
    """An empty list whose ``len`` is the prompt's token count (no ids are materialised: a
    128K-token prompt costs nothing); :attr:`job` is the request it is."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def __len__(self) -> int:
        return self.job.prompt_tokens
