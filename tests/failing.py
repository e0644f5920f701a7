"""A strategy that breaks at run time, for the tests that prove a failed point does not stop a sweep."""
from strategies.caches.contiguous import ContiguousStrategy


class ExplodingStrategy(ContiguousStrategy):
    def new_session(self, model, batch, max_len):
        raise RuntimeError("kernel error planted by the test")
