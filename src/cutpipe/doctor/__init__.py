"""What a machine needs for pipelined training on GPUs: the checks behind ``cutpipe doctor``."""
