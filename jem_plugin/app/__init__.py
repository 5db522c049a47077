"""The application layer: the ``jem`` command, its model files, the digits experiment, the report,
data sets and small networks.

Built on the public library; the library never imports anything from here.
"""

from ..errors import JEMError


class CLIError(JEMError):
    """A user error at the command line: printed as one line, exit status 2."""
