"""What both daemons share as programs: listening services, endpoint and option checks, the
clean exit after SIGTERM, and the HTTP guards every listener puts in front of its resources.

May import ``sfnode.linkf`` only: both command lines import it while ``twistd --help`` runs.
"""
