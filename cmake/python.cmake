# The Python module: qkv._qkv (src/python/, nanobind) plus the pure-Python package python/qkv/.
# Built when QKV_BUILD_PYTHON is on: by `pip install .` (scikit-build-core, pyproject.toml) and
# by scripts/test.sh, which points Python_EXECUTABLE at the test venv (scripts/python_env.sh).
# In the build tree the package is assembled in <build>/python/qkv/, so that
# PYTHONPATH=<build>/python imports it; the wheel installs the same files (component python).
find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module
  OPTIONAL_COMPONENTS Development.SABIModule)
if(NOT nanobind_ROOT)
  execute_process(COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
    OUTPUT_VARIABLE nanobind_ROOT OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
endif()
find_package(nanobind CONFIG REQUIRED)

set(QKV_PYTHON_PACKAGE_DIR ${PROJECT_BINARY_DIR}/python/qkv)
# STABLE_ABI: one abi3 wheel for every CPython >= 3.12; older Pythons get a version-specific one.
nanobind_add_module(_qkv STABLE_ABI NB_STATIC src/python/module.cc src/python/arrays.cc
  src/python/options.cc src/python/layers.cc)
target_include_directories(_qkv PRIVATE src)
target_link_libraries(_qkv PRIVATE qkv::qkv)
if(QKV_BUILD_DISTRIBUTED)  # qkv.ring_attention (an mpi4py communicator)
  target_sources(_qkv PRIVATE src/python/ring.cc)
  target_compile_definitions(_qkv PRIVATE QKV_WITH_MPI=1)
endif()
set_target_properties(_qkv PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${QKV_PYTHON_PACKAGE_DIR})

file(GLOB QKV_PYTHON_FILES CONFIGURE_DEPENDS python/qkv/*.py python/qkv/*.pyi python/qkv/py.typed)
foreach(file IN LISTS QKV_PYTHON_FILES)
  get_filename_component(name ${file} NAME)
  configure_file(${file} ${QKV_PYTHON_PACKAGE_DIR}/${name} COPYONLY)
endforeach()

# Type stubs of the extension (nanobind's stubgen, run on the built module); the package's own
# API (__init__.py, torch.py) carries its annotations inline, marked by py.typed.
nanobind_add_stub(_qkv_stub MODULE _qkv OUTPUT ${QKV_PYTHON_PACKAGE_DIR}/_qkv.pyi
  PYTHON_PATH ${QKV_PYTHON_PACKAGE_DIR} DEPENDS _qkv)

install(TARGETS _qkv LIBRARY DESTINATION qkv COMPONENT python)
install(FILES ${QKV_PYTHON_FILES} ${QKV_PYTHON_PACKAGE_DIR}/_qkv.pyi DESTINATION qkv
  COMPONENT python)
