"""The command line: `vlmrl` and its commands (the top layer; nothing imports it).

- `app`     the typer app: argument handling, one function per command
- `show`    everything printed to the console (rich), progress and the before/after table
- `errors`  user errors as one line with exit 2, the run-folder claim around a command
- `launch`  `--gpus/--nodes`: relaunching a command under accelerate
- `help`    shared option types, help texts and `--version`
"""
