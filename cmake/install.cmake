# `cmake --install build/release --prefix P` installs the qkv command, the public headers, the
# static libraries and a CMake package, so that another project can
#   find_package(qkv CONFIG REQUIRED)                         # or COMPONENTS attention
#   target_link_libraries(app PRIVATE qkv::qkv)               # or qkv::attention, ...
# (examples/ is such a project). The package config finds Highway, OpenMP and, unless only the
# attention component is asked for, oneDNN itself (cmake/qkvConfig.cmake.in).
include(CMakePackageConfigHelpers)

set(QKV_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/qkv)

install(TARGETS qkv RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT cpp)
set(QKV_INSTALLED_LIBRARIES qkv_attention qkv_layers qkv_models)
if(QKV_BUILD_DISTRIBUTED)
  list(APPEND QKV_INSTALLED_LIBRARIES qkv_distributed)
endif()
install(TARGETS ${QKV_INSTALLED_LIBRARIES} qkv_all EXPORT qkvTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT cpp)
install(DIRECTORY include/qkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT cpp)
install(EXPORT qkvTargets NAMESPACE qkv:: DESTINATION ${QKV_INSTALL_CMAKEDIR} COMPONENT cpp)

set(QKV_WITH_MPI ${QKV_BUILD_DISTRIBUTED})
configure_package_config_file(cmake/qkvConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/qkvConfig.cmake INSTALL_DESTINATION ${QKV_INSTALL_CMAKEDIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/qkvConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/qkvConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/qkvConfigVersion.cmake
  DESTINATION ${QKV_INSTALL_CMAKEDIR} COMPONENT cpp)
