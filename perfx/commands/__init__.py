"""The `perfx` commands, one module each (``add_arguments(parser)`` and ``main(args) -> exit status``);
``perfx.cli`` puts them together. They sit on top of every other layer."""
