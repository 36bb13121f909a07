"""The decode loop: scheduling, the n-gram drafter, the loop around the step engine."""
