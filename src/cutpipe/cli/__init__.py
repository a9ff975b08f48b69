"""The ``cutpipe`` command."""
