"""nixl-bounce: the BOUNCE backend plugin for NIXL, packaged as a wheel.

The wheel carries the plugin (`libplugin_BOUNCE.so`) as package data and the `nixl-bounce`
command, which copies it into the plugin directory of an installed NIXL (`install`), removes it
(`uninstall`) and checks the whole set-up (`doctor`).
"""
import os

__version__ = "0.1.0"

PLUGIN_FILE = "libplugin_BOUNCE.so"

#: NIXL releases this build was tested against. The plugin itself carries the same list (its
#: version guard) and exports it; `doctor` reads it from the .so, checks against the plugin's
#: list (what the guard enforces), and WARNs when the two lists differ. This one is used only
#: when the plugin exports none (an older build) or cannot be loaded.
TESTED_NIXL_VERSIONS = ("1.5.1",)

#: The environment variable that lets the plugin load into an untested NIXL anyway.
ALLOW_UNTESTED_ENV = "NIXL_BOUNCE_ALLOW_UNTESTED_NIXL"


def bundled_plugin():
    """Path of the plugin shipped in this wheel."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), PLUGIN_FILE)
