"""The ``jem`` subcommands, one module each: ``add_parser(sub, common)`` defines its options,
``run(args)`` carries it out. ``cli.build_parser`` adds them in the order of ``jem --help``."""
