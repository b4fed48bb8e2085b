"""Commands that are not twistd plugins: the local fleet behind ``make run`` and the generated
option tables.  The top layer: may import anything of sfnode; nothing imports it.
"""
