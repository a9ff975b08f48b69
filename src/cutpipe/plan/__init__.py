"""Planning a real job: costs from model and hardware, partitions, cost-aware schedules, advice."""
