"""torch and CPython as a release that renamed or changed an internal ddpkit's launcher overrides
would be: each change made, from torch's own source, in the interpreter that runs ``REWRITE`` and
then ``TORCH_CHANGES[change]`` (``python -c``), before ddpkit is imported."""

REWRITE = '''
import inspect, re, sys, tempfile, textwrap

def rewrite(module_name, target, edits):
    """Define ``target`` (a class of the module, or ``Class.method``) again from torch's source,
    with each (pattern, replacement) of ``edits`` applied, in a file of its own (where ``inspect``
    finds the new source); every module that imported the old class gets the new one."""
    module = __import__(module_name, fromlist=["_"])
    if "." in target:
        owner, name = getattr(module, target.split(".")[0]), target.split(".")[1]
    else:
        owner, name = module, target
    old = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(old))
    for pattern, replacement in edits:
        source, count = re.subn(pattern, replacement, source)
        assert count, (pattern, target)
    scope = dict(vars(module))
    # In the test\'s folder.
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=".", delete=False) as f:
        f.write(source)
    exec(compile(source, f.name, "exec"), scope)
    setattr(owner, name, scope[name])
    if owner is module:
        for other in list(sys.modules.values()):
            if getattr(other, name, None) is old:
                setattr(other, name, scope[name])

HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"
AGENT_API = "torch.distributed.elastic.agent.server.api"
'''

TORCH_CHANGES = {
    # SubprocessHandler starts its process through a step of another name.
    "popen renamed": 'rewrite(HANDLER, "SubprocessHandler", [(r"\\b_popen\\b", '
    '"_start_process")])\n',
    # __init__ no longer starts its process through self._popen (a subclass's _popen is never
    # called).
    "popen not called": 'rewrite(HANDLER, "SubprocessHandler", [(r"self\\._popen\\(", '
    '"SubprocessHandler._popen(self, ")])\n',
    # The log files a handler opened for its worker kept under other names.
    "log files renamed": 'rewrite(HANDLER, "SubprocessHandler", [(r"\\b_stdout\\b", "_out"), '
    '(r"\\b_stderr\\b", "_err")])\n',
    # What a forked worker runs to end as an interpreter ends, gone from CPython.
    "atexit._run_exitfuncs gone": "import atexit\ndel atexit._run_exitfuncs\n",
    # The agent's poll of its workers renamed, in the agent and in the loop that calls it.
    "monitor renamed": (
        "from torch.distributed.elastic.agent.server.api import SimpleElasticAgent\n"
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "LocalElasticAgent._poll_workers = LocalElasticAgent._monitor_workers\n"
        "del LocalElasticAgent._monitor_workers, SimpleElasticAgent._monitor_workers\n"
        'rewrite(AGENT_API, "SimpleElasticAgent._invoke_run", [(r"self\\._monitor_workers\\(", '
        '"self._poll_workers(")])\n'
    ),
    # The loop polls the workers through another step; _monitor_workers is still there, never
    # called.
    "monitor bypassed": (
        "from torch.distributed.elastic.agent.server.api import SimpleElasticAgent\n"
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "SimpleElasticAgent._poll_workers = LocalElasticAgent._monitor_workers\n"
        'rewrite(AGENT_API, "SimpleElasticAgent._invoke_run", [(r"self\\._monitor_workers\\(", '
        '"self._poll_workers(")])\n'
    ),
}
