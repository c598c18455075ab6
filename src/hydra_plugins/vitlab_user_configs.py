"""A user's config tree (`--config-dir <dir>` on a vitlab command line: vitlab.cli.config_tree.read_user_config_dir)
searched before vitlab's own conf/, so that the user's experiment/, model/, data/ ... files compose over ours and one
of the same name as ours takes its place. Hydra finds search-path plugins only in the `hydra_plugins` namespace; it
calls this for every config search path it makes (a command's, the compose API's), and without a user's tree (any
other Hydra application, vitlab's tests) it changes nothing. (Hydra's own `--config-dir` puts the folder after the
primary tree: a file named as one of ours would never be read.)"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VitlabUserConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from vitlab.cli.config_tree import user_config_dir

        user = user_config_dir()
        if user is not None and any(e.provider == "main" for e in search_path.get_path()):
            search_path.prepend(provider="vitlab-user", path=f"file://{user}", anchor="main")
