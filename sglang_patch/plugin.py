def load_plugin():
    import os, sys
    mods = ['sglang.srt.managers.scheduler','sglang.srt.managers.tokenizer_control_mixin','sglang.srt.managers.data_parallel_controller','sglang.srt.entrypoints.http_server','sglang.srt.managers.io_struct','sglang.srt.server_args', 'torch']
    with open('/tmp/plugin_probe.txt','a') as f:
        f.write(f"{os.getpid()} {sys.argv[:2]} {[m.rsplit('.',1)[-1] for m in mods if m in sys.modules]}\n")
