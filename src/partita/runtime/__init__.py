"""Doing what a plan says, on torch.distributed: stages, schedules, routing, gradient sums."""
